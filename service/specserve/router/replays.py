"""Which request bodies the dispatch may replay after their arm's replica died.

A request is replayed once when its replica dies before answering (or is resumed once when its
stream is cut). A body that kills the engine serving it would kill the next one too, so what
counts is how a body's replay went:

- its replay lost its replica as well: the body is refused any further replay, for a while,
  whichever client sends it (a request that kills an engine does not kill a second one);
- its replay was answered: the body is harmless, and replayed again when an engine dies under it;
- a replay of it is under way: an identical request cut by the same failure waits for that one's
  fate before it is replayed, so copies of a poisonous body cannot spread over other engines.

Many users send identical bodies (a common prompt; a client's retry; a benchmark's fixed set),
and one engine's death cuts them all at once: each is replayed, none refused for another's sake.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

# How long a body's replay is remembered, and how many bodies at most (oldest forgotten first).
REMEMBER_S = 600.0
MAX_REMEMBERED = 4096


class Fate(enum.Enum):
    """How a replay went."""

    ANSWERED = "answered"  # the arm answered it to the end
    REPLICA_DIED = "replica_died"  # its replica died too, before or while answering
    UNKNOWN = "unknown"  # the client left, or Ray Serve refused it: nothing learnt of the body


@dataclass
class _Replays:
    at: float
    fate: Fate | None = None  # None while the first replay is under way
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class Ticket:
    """Leave to replay one request; `settle` says how its replay went (exactly once)."""

    def __init__(self, bodies: ReplayedBodies, key: bytes, entry: _Replays | None) -> None:
        self._bodies, self._key, self._entry = bodies, key, entry

    def settle(self, fate: Fate) -> None:
        entry, self._entry = self._entry, None
        if entry is None:  # settled already, or a replay of a body proven harmless
            if fate is Fate.REPLICA_DIED:
                self._bodies.refuse(self._key)
            return
        if fate is Fate.UNKNOWN:
            self._bodies.forget(self._key, entry)
        else:
            entry.fate = fate
        entry.settled.set()


class ReplayedBodies:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._bodies: OrderedDict[bytes, _Replays] = OrderedDict()  # body digest -> its replays

    async def admit(self, body: bytes) -> Ticket | None:
        """A ticket to replay this body, or None if a replay of it lost its replica too. Waits
        while the first replay of the same body is under way."""
        key = hashlib.sha256(body).digest()
        while True:
            self._forget_old()
            entry = self._bodies.get(key)
            if entry is None:
                entry = self._bodies[key] = _Replays(at=self.clock())
                return Ticket(self, key, entry)
            if entry.fate is Fate.REPLICA_DIED:
                return None
            if entry.fate is Fate.ANSWERED:
                return Ticket(self, key, None)
            await entry.settled.wait()

    def refuse(self, key: bytes) -> None:
        self._bodies.pop(key, None)
        self._bodies[key] = _Replays(at=self.clock(), fate=Fate.REPLICA_DIED)

    def forget(self, key: bytes, entry: _Replays) -> None:
        if self._bodies.get(key) is entry:
            del self._bodies[key]

    def _forget_old(self) -> None:
        now = self.clock()
        while self._bodies:
            oldest = next(iter(self._bodies.values()))
            if len(self._bodies) < MAX_REMEMBERED and oldest.at >= now - REMEMBER_S:
                break
            self._bodies.popitem(last=False)
            oldest.settled.set()  # anyone still waiting on it asks again
