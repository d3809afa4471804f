"""Acceptance-collapse guardrail: drain an arm whose drafts stop being accepted.

A drafter that does not match its target (a wrong checkpoint, a changed chat template, a new
target version) still produces tokens, only slowly: every draft is rejected and the arm serves
at below no-spec speed. The guardrail keeps, per arm, the verify steps and accepted draft tokens
of the requests that finished within the window; when there are enough steps to judge and the
mean acceptance length (1 + accepted / steps, vLLM's definition) is below the floor, the arm is
drained: weighted and sticky traffic goes to the other arms for `drain_s`, then it takes traffic
again and is judged on fresh requests only. Each router (the dispatch in one HTTP proxy) judges
the traffic it saw.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from specserve.config.schema import GuardrailConfig

logger = logging.getLogger(__name__)


class AcceptanceGuard:
    def __init__(
        self, config: GuardrailConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        # arm -> (finished at, verify steps, accepted draft tokens) per request, oldest first
        self._window: dict[str, deque[tuple[float, int, int]]] = {}
        self._drained_until: dict[str, float] = {}

    def observe(self, arm: str, steps: int, accepted: int) -> bool:
        """Record one finished request's draft stats; True when this drains the arm."""
        floor = self.config.min_acceptance_length
        if floor is None or steps <= 0 or arm in self.drained():
            return False
        now = self.clock()
        window = self._window.setdefault(arm, deque())
        window.append((now, steps, accepted))
        while window and window[0][0] < now - self.config.window_s:
            window.popleft()
        total_steps = sum(s for _, s, _ in window)
        if total_steps < self.config.min_drafts:
            return False
        mean = 1 + sum(a for _, _, a in window) / total_steps
        if mean >= floor:
            return False
        self._drained_until[arm] = now + self.config.drain_s
        window.clear()  # judged afresh when it returns
        logger.warning(
            "arm %s drained for %g s: mean acceptance length %.2f < %g over %d verify steps "
            "in the last %g s",
            arm,
            self.config.drain_s,
            mean,
            floor,
            total_steps,
            self.config.window_s,
        )
        return True

    def drained(self) -> frozenset[str]:
        now = self.clock()
        for arm, until in list(self._drained_until.items()):
            if until <= now:
                del self._drained_until[arm]
                logger.info("arm %s takes traffic again after its drain", arm)
        return frozenset(self._drained_until)

    def reconfigure(self, config: GuardrailConfig) -> None:
        """A new config: drains and windows start over (the floor or the drafter may differ)."""
        if config != self.config:
            self.config = config
            self._window.clear()
            self._drained_until.clear()
