"""Which request bodies the dispatch has replayed after their arm's replica died.

A request is replayed once when its replica dies before answering. A request that kills the
engine serving it (a prompt that crashes it) would kill the next one too: a body that was
already replayed is not replayed again, for a while, whichever client sends it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

# How long a replayed body is remembered, and how many at most (oldest forgotten first).
REMEMBER_S = 600.0
MAX_REMEMBERED = 4096


class ReplayedBodies:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # body digest -> replayed at

    def first_time(self, body: bytes) -> bool:
        """True (and remembered) if this body has not been replayed within REMEMBER_S."""
        now = self.clock()
        while self._seen and (
            len(self._seen) >= MAX_REMEMBERED or next(iter(self._seen.values())) < now - REMEMBER_S
        ):
            self._seen.popitem(last=False)
        key = hashlib.sha256(body).digest()
        if key in self._seen:
            return False
        self._seen[key] = now
        return True
