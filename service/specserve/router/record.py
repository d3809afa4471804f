"""What one request did, turned into the router's per-arm metrics once, when it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specserve.metrics import (
    NO_ARM,
    NO_KEY,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_REJECTED,
    OUTCOME_SERVER_ERROR,
    RouterMetrics,
)
from specserve.router.guardrail import AcceptanceGuard

# Statuses that mean "at capacity, come back later" rather than a failure.
REJECTED_STATUSES = frozenset({429, 503})


def outcome_of_status(status: int) -> str:
    if status in REJECTED_STATUSES:
        return OUTCOME_REJECTED
    return OUTCOME_CLIENT_ERROR if status < 500 else OUTCOME_SERVER_ERROR


class InFlight:
    """Requests a router has started and not yet finished, streams included."""

    def __init__(self) -> None:
        self.count = 0

    def start(self) -> None:
        self.count += 1

    def end(self) -> None:
        self.count -= 1


@dataclass
class RequestRecord:
    """What one request did; turned into metrics once, when it ends. The arm stays `NO_ARM`
    for a request refused before one was chosen."""

    endpoint: str
    arm: str = NO_ARM
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_tokens: int = 0
    spec_decode: dict[str, Any] | None = None
    outcome: str = OUTCOME_OK
    finished: bool = False
    # Chosen by the weights or a sticky key (not forced): only these feed the A/B statistics.
    randomized: bool = True
    key: str = NO_KEY  # the sending key's name, the A/B statistics' segment
    unit_bucket: str = "0"  # its randomisation unit's bucket (selection.unit_bucket)
    # Its prompt is one the config leaves out of the A/B (routing.ab_left_out_prompts): served,
    # guarded, but not in the A/B statistics.
    left_out: bool = False
    # Told the draft stats of each successful request (the acceptance guardrail).
    guard: AcceptanceGuard | None = None
    in_flight: InFlight | None = None

    def __post_init__(self) -> None:
        if self.in_flight is not None:
            self.in_flight.start()

    def fail(self, status: int, metrics: RouterMetrics) -> None:
        """End the request with the outcome its HTTP status means."""
        self.outcome = outcome_of_status(status)
        self.finish(metrics)

    def finish(self, metrics: RouterMetrics) -> None:
        if self.finished:
            return
        self.finished = True
        if self.in_flight is not None:
            self.in_flight.end()
        now = time.perf_counter()
        metrics.count_request(self.arm, self.endpoint, self.outcome)
        if self.outcome != OUTCOME_OK:
            return
        ttft_s = tpot_s = None
        if self.first_token_at is not None:
            ttft_s = self.first_token_at - self.started
            if self.output_tokens > 1:
                tpot_s = (now - self.first_token_at) / (self.output_tokens - 1)
        in_ab = self.randomized and not self.left_out
        if self.left_out:
            metrics.count_left_out(self.arm)
        metrics.observe_request(
            self.arm,
            e2e_s=now - self.started,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            output_tokens=self.output_tokens,
            randomized=in_ab,
            key=self.key,
            unit_bucket=self.unit_bucket,
        )
        if self.spec_decode:
            metrics.observe_spec_decode(
                self.arm,
                self.spec_decode,
                randomized=in_ab,
                key=self.key,
                unit_bucket=self.unit_bucket,
            )
            if self.guard is not None and self.guard.observe(
                self.arm,
                int(self.spec_decode.get("num_spec_steps") or 0),
                int(self.spec_decode.get("num_accepted_draft_tokens") or 0),
            ):
                metrics.count_drain(self.arm)

    def read_usage(self, usage: dict | None, extra_metrics: dict | None) -> None:
        if usage:
            self.output_tokens = int(usage.get("completion_tokens") or 0)
        if extra_metrics:
            self.spec_decode = extra_metrics.get("speculative_decoding")
