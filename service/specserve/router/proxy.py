"""Forward one request to an arm's engine and record what happened, per arm.

Streams pass through chunk by chunk. The router always asks the engine for the final usage chunk
(it carries the token count and vLLM's per-request speculative-decoding stats) and drops it again
when the client did not ask for usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response, StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from specserve.headers import RETRY_AFTER
from specserve.metrics import (
    NO_ARM,
    OUTCOME_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_REJECTED,
    OUTCOME_SERVER_ERROR,
    RouterMetrics,
)
from specserve.router.errors import OpenAIError, error_body, request_id
from specserve.router.guardrail import AcceptanceGuard

logger = logging.getLogger(__name__)

_SSE_DONE = "data: [DONE]"
# Statuses that mean "at capacity, come back later" rather than a failure.
REJECTED_STATUSES = frozenset({429, 503})


def outcome_of_status(status: int) -> str:
    if status in REJECTED_STATUSES:
        return OUTCOME_REJECTED
    return OUTCOME_CLIENT_ERROR if status < 500 else OUTCOME_SERVER_ERROR


class InFlight:
    """Requests a router replica has started and not yet finished, streams included."""

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
        metrics.observe_request(
            self.arm,
            e2e_s=now - self.started,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            output_tokens=self.output_tokens,
        )
        if self.spec_decode:
            metrics.observe_spec_decode(self.arm, self.spec_decode)
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


def _engine_error(chunk: Any) -> Any | None:
    """The error detail if the engine answered with an ErrorResponse (vLLM's or Ray's class)."""
    return getattr(chunk, "error", None)


def _raise_engine_error(status: int, detail: Any) -> None:
    if status >= 500:
        logger.error("request %s: engine error %s: %s", request_id(), status, detail.message)
        raise OpenAIError(status, "Internal Server Error", type="server_error")
    raise OpenAIError(status, detail.message, type=detail.type, param=detail.param)


def _overloaded(exc: BackPressureError, arm: str) -> OpenAIError:
    retry_after_s = max(1, math.ceil(exc.retry_after_s or 1))
    return OpenAIError(
        exc.status_code if exc.status_code in REJECTED_STATUSES else 503,
        f"arm {arm!r} is at capacity (its request queue is full); retry after {retry_after_s} s",
        code="arm_overloaded",
        headers={RETRY_AFTER: str(retry_after_s)},
    )


async def forward(
    handle: DeploymentHandle,
    method: str,
    body: Any,
    record: RequestRecord,
    metrics: RouterMetrics,
    *,
    client_wants_usage: bool,
    headers: dict[str, str],
    timeout_s: float,
) -> Response:
    """Call `method` (chat or completions) on the arm and build the HTTP response. `timeout_s`
    bounds the whole request, a stream included."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    generator = getattr(handle, method).remote(body, None)
    try:
        async with asyncio.timeout_at(deadline):
            try:
                first = await generator.__anext__()
            except RayActorError as exc:
                # The replica died (or became unreachable) before sending anything, so nothing
                # reached the client: replay once; Ray Serve routes it to a live replica.
                logger.warning(
                    "request %s: arm %s replica failed before the first byte (%s); retrying once",
                    request_id(),
                    record.arm,
                    type(exc).__name__,
                )
                metrics.count_retry(record.arm)
                generator = getattr(handle, method).remote(body, None)
                first = await generator.__anext__()
    except TimeoutError:
        generator.cancel()
        record.fail(504, metrics)
        raise OpenAIError(504, f"no response from the model within {timeout_s:g} s") from None
    except RayActorError:
        record.fail(500, metrics)
        raise OpenAIError(
            503,
            f"arm {record.arm!r} failed twice for this request; retry later",
            code="engine_unavailable",
            headers={RETRY_AFTER: "1"},
        ) from None
    except BackPressureError as exc:
        overloaded = _overloaded(exc, record.arm)
        record.fail(overloaded.status, metrics)
        raise overloaded from None
    except Exception:
        record.fail(500, metrics)
        raise
    chunk = first[0] if isinstance(first, list) else first
    error = _engine_error(chunk)
    if error is not None:
        generator.cancel()
        status = int(error.code) if str(error.code).isdigit() else 500
        record.fail(status, metrics)
        _raise_engine_error(status, error)

    if not getattr(body, "stream", False):
        payload = chunk.model_dump(mode="json", exclude_none=True)
        record.read_usage(payload.get("usage"), payload.get("metrics"))
        record.finish(metrics)
        return Response(json.dumps(payload), media_type="application/json", headers=headers)

    return StreamingResponse(
        _stream(first, generator, record, metrics, client_wants_usage, deadline, timeout_s),
        media_type="text/event-stream",
        headers=headers,
    )


def _error_event(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n{_SSE_DONE}\n\n"


async def _stream(
    first: Any,
    rest: AsyncIterator[Any],
    record: RequestRecord,
    metrics: RouterMetrics,
    client_wants_usage: bool,
    deadline: float,
    timeout_s: float,
) -> AsyncIterator[str]:
    """Pass the stream through. It always ends with `[DONE]`; one cut short (timeout, a failed
    engine) ends with an OpenAI error event first, never silently."""
    record.first_token_at = time.perf_counter()
    done_sent = False
    try:
        item = first
        while True:
            for event in item if isinstance(item, list) else [item]:
                text = event if isinstance(event, str) else f"data: {event.model_dump_json()}\n\n"
                if '"usage"' in text and '"choices":[]' in text:
                    _read_usage_event(text, record)
                    if not client_wants_usage:
                        continue
                if text.startswith(_SSE_DONE):
                    done_sent = True
                yield text
            try:
                async with asyncio.timeout_at(deadline):
                    item = await rest.__anext__()
            except StopAsyncIteration:
                break
        if not done_sent:
            yield f"{_SSE_DONE}\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        record.outcome = OUTCOME_CANCELLED
        raise
    except TimeoutError:
        record.outcome = OUTCOME_SERVER_ERROR
        logger.warning(
            "request %s on arm %s: stream cut at %g s", request_id(), record.arm, timeout_s
        )
        yield _error_event(504, f"the request ran longer than {timeout_s:g} s and was stopped")
    except Exception:
        # The status line is sent; the client learns of the failure from the error event.
        record.outcome = OUTCOME_SERVER_ERROR
        logger.exception("request %s: stream from arm %s failed", request_id(), record.arm)
        yield _error_event(500, "the model failed mid-stream; the answer is incomplete")
    finally:
        if record.outcome != OUTCOME_OK and hasattr(rest, "cancel"):
            rest.cancel()
        record.finish(metrics)


def _read_usage_event(text: str, record: RequestRecord) -> None:
    try:
        payload = json.loads(text.removeprefix("data: ").strip())
    except ValueError:
        logger.warning("unparseable usage chunk from arm %s", record.arm)
        return
    record.read_usage(payload.get("usage"), payload.get("metrics"))
