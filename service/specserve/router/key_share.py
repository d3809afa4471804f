"""One API key's share of what an arm's A/B statistics and acceptance guardrail are computed
from, bounded (`routing.max_key_share`).

Rate limits bound a key's volume, not its weight in a verdict: a key that sends most of an arm's
sticky traffic would make most of that arm's A/B figures, or drain it with requests whose drafts
all fail. Per arm, the dispatch keeps the keys of the last `routing.key_share_window` requests it
counted; a request whose key already holds `max_key_share` of that window is served as any other
but counted nowhere. So among any `window` consecutive requests counted for an arm, no key has
more than its share. The price: with fewer active keys than 1 / share, the statistics grow only
as fast as the other keys send (one key alone stops being counted once it fills its share).
"""

from __future__ import annotations

import math
from collections import Counter, deque


class KeyShare:
    def __init__(self) -> None:
        self._recent: dict[
            str, deque[str]
        ] = {}  # arm -> keys of the requests counted, oldest first
        self._held: dict[str, Counter[str]] = {}  # arm -> key -> how many of those

    def count(self, arm: str, key: str, share: float | None, window: int) -> bool:
        """Whether a request of `key` on `arm` may feed the arm's statistics (and is counted)."""
        if share is None:
            return True
        recent = self._recent.setdefault(arm, deque())
        held = self._held.setdefault(arm, Counter())
        if held[key] >= max(1, math.floor(share * window)):
            return False
        recent.append(key)
        held[key] += 1
        while len(recent) > window:
            oldest = recent.popleft()
            held[oldest] -= 1
            if not held[oldest]:
                del held[oldest]
        return True
