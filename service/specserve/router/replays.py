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

A body is known by what the engine generates from, as sent by one API key (`replay_identity`):
fields that do not change the generation (`user`, `seed`, ...), key order and spacing do not
make it a new body. And each key has a budget: once one of its bodies killed the replica of its
replay too, none of that key's requests is replayed for a while (an engine death under them
answers 503), so a key that sends new poisonous bodies kills one engine with each, not two.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How long a body's replay is remembered, and how many bodies at most (oldest forgotten first).
REMEMBER_S = 600.0
MAX_REMEMBERED = 4096
# Bodies of one API key whose replay lost its replica too, within REMEMBER_S, before none of
# that key's requests is replayed.
POISON_BUDGET_PER_KEY = 1
# Body fields that do not change what the engine generates from, or only its sampling draw.
VOLATILE_FIELDS = frozenset({"user", "request_id", "seed", "stream", "stream_options", "metadata"})


def replay_identity(data: dict[str, Any], key_name: str | None) -> bytes:
    """What a request is known by among replays: its body without volatile fields, canonical,
    and the API key that sent it."""
    kept = {k: v for k, v in data.items() if k not in VOLATILE_FIELDS}
    return json.dumps([key_name, kept], sort_keys=True, separators=(",", ":")).encode()


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

    def __init__(
        self, bodies: ReplayedBodies, key: bytes, entry: _Replays | None, owner: str | None
    ) -> None:
        self._bodies, self._key, self._entry, self._owner = bodies, key, entry, owner

    def settle(self, fate: Fate) -> None:
        entry, self._entry = self._entry, None
        if fate is Fate.REPLICA_DIED and self._owner is not None:
            self._bodies.poisoned_by(self._owner)
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
        self._poisoned: dict[str, list[float]] = {}  # API key name -> when its bodies killed two

    async def admit(self, body: bytes, owner: str | None = None) -> Ticket | None:
        """A ticket to replay this body (sent by API key `owner`), or None if a replay of it
        lost its replica too, or the key's budget is spent. Waits while the first replay of the
        same body is under way."""
        key = hashlib.sha256(body).digest()
        while True:
            self._forget_old()
            if owner is not None and len(self._poisoned.get(owner, ())) >= POISON_BUDGET_PER_KEY:
                return None
            entry = self._bodies.get(key)
            if entry is None:
                entry = self._bodies[key] = _Replays(at=self.clock())
                return Ticket(self, key, entry, owner)
            if entry.fate is Fate.REPLICA_DIED:
                return None
            if entry.fate is Fate.ANSWERED:
                return Ticket(self, key, None, owner)
            await entry.settled.wait()

    def poisoned_by(self, owner: str) -> None:
        self._poisoned.setdefault(owner, []).append(self.clock())

    def refuse(self, key: bytes) -> None:
        self._bodies.pop(key, None)
        self._bodies[key] = _Replays(at=self.clock(), fate=Fate.REPLICA_DIED)

    def forget(self, key: bytes, entry: _Replays) -> None:
        if self._bodies.get(key) is entry:
            del self._bodies[key]

    def _forget_old(self) -> None:
        now = self.clock()
        for owner, times in list(self._poisoned.items()):
            times[:] = [at for at in times if at >= now - REMEMBER_S]
            if not times:
                del self._poisoned[owner]
        while self._bodies:
            oldest = next(iter(self._bodies.values()))
            if len(self._bodies) < MAX_REMEMBERED and oldest.at >= now - REMEMBER_S:
                break
            self._bodies.popitem(last=False)
            oldest.settled.set()  # anyone still waiting on it asks again
