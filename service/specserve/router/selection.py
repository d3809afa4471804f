"""Arm selection: override > sticky key > random, all by the configured weights of the arms
that are running; a request only some arms can serve goes to one of them, outside the split.

Sticky keys use weighted rendezvous hashing: each (key, arm) pair gets a pseudo-random score
`weight / -ln(u)` with `u` uniform in (0, 1) from a hash, and the key goes to the best-scoring arm.
The chance an arm wins is its share of the weights; a key keeps its arm while the weights stay the
same; and when one arm's weight grows, keys only move *to* that arm (when it shrinks, only *from*
it), which is the least movement any scheme can have. An arm that is not running drops out of
the weights; its keys go to their next-best running arm and return when it runs again, while the
keys of every other arm stay where they are.

The hash is keyed with a per-deployment secret (`load_salt`): without it, a client could work out
offline which session ids land on which arm and pick its arm by its id.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import NamedTuple

from specserve.metrics import (
    SELECTED_BY_CAPABILITY,
    SELECTED_BY_OVERRIDE,
    SELECTED_BY_STICKY,
    SELECTED_BY_WEIGHT,
    UNIT_BUCKETS,
)

_TWO_64 = float(2**64)
logger = logging.getLogger(__name__)


class UnknownArmError(LookupError):
    def __init__(self, arm: str, known: list[str]) -> None:
        super().__init__(f"unknown arm {arm!r}; arms: {', '.join(known)}")
        self.arm = arm


class ArmNotRunningError(LookupError):
    """The override header named an arm whose engine is not running, or no arm with weight > 0
    is running at all."""


class NoAbleArmError(LookupError):
    """No running arm can serve the request (every one speculates, and the request asks for
    sampling that speculative decoding refuses)."""


class Selection(NamedTuple):
    arm: str
    selected_by: str  # one of metrics.SELECTED_BY_*
    # The arm the weights or sticky key chose first, when it was not running.
    fallback_from: str | None = None


def load_salt(path: str | None) -> bytes:
    """The sticky hash's key from a secret file (its SHA-256: any length of secret fits);
    b"" (unsalted) without one. A named file that cannot be read is logged, and unsalted."""
    if not path:
        return b""
    try:
        return hashlib.sha256(Path(path).read_bytes()).digest()
    except OSError as exc:
        logger.error("sticky keys are hashed unsalted: cannot read %s (%s)", path, exc)
        return b""


def _uniform(key: str, arm: str, salt: bytes = b"") -> float:
    # Keyed BLAKE2b; an empty key is the plain hash.
    digest = hashlib.blake2b(f"{key}\x00{arm}".encode(), digest_size=8, key=salt).digest()
    # Map to (0, 1): never 0 (log) and never 1 (division by zero).
    return (int.from_bytes(digest, "big") + 0.5) / _TWO_64


def sticky_arm(key: str, weights: Mapping[str, float], salt: bytes = b"") -> str:
    """The arm a sticky key maps to; only arms with weight > 0 can win."""
    best, best_score = "", -1.0
    for arm, weight in weights.items():
        if weight <= 0:
            continue
        score = weight / -math.log(_uniform(key, arm, salt))
        if score > best_score:
            best, best_score = arm, score
    if not best:
        raise ValueError("no arm has weight > 0")
    return best


def unit_bucket(sticky_key: str | None, salt: bytes = b"", rng: random.Random | None = None) -> str:
    """The bucket (of metrics.UNIT_BUCKETS) of a request's randomisation unit: its sticky key's,
    the same for every request of the key and independent of the key's arm (another hash input);
    a random one for a request without a key (the request is its own unit)."""
    if not sticky_key:
        return str((rng or random).randrange(UNIT_BUCKETS))
    digest = hashlib.blake2b(f"{sticky_key}\x01unit".encode(), digest_size=8, key=salt).digest()
    return str(int.from_bytes(digest, "big") % UNIT_BUCKETS)


def random_arm(weights: Mapping[str, float], rng: random.Random | None = None) -> str:
    arms = [arm for arm, weight in weights.items() if weight > 0]
    if not arms:
        raise ValueError("no arm has weight > 0")
    return (rng or random).choices(arms, weights=[weights[a] for a in arms])[0]


def choose_arm(
    weights: Mapping[str, float],
    *,
    routable: Collection[str] | None = None,
    drained: Collection[str] = (),
    override: str | None = None,
    sticky_key: str | None = None,
    salt: bytes = b"",
    rng: random.Random | None = None,
    able: Collection[str] | None = None,
) -> Selection:
    """Pick the arm for one request. An override may name any configured arm, even weight 0,
    as long as it takes traffic; the weights and sticky keys only ever pick arms in `routable`
    (readiness.routable: running, or redeploying while the old replicas serve; all arms when
    None), and not drained ones unless every routable arm is drained. In this module and its
    errors, "running" means routable. With `able` (the arms that can serve this request; all
    when None) an unforced request goes to one of them, by their weights (evenly where all are
    0), sticky keys kept: a choice made for the request, not randomized."""
    is_running = (lambda arm: True) if routable is None else (lambda arm: arm in routable)
    if override is not None:
        if override not in weights:
            raise UnknownArmError(override, sorted(weights))
        if not is_running(override):
            raise ArmNotRunningError(f"arm {override!r} is not running")
        return Selection(override, SELECTED_BY_OVERRIDE)
    live = {arm: weight for arm, weight in weights.items() if is_running(arm)}
    if able is not None:
        return _among_able(live, able, drained, sticky_key, salt, rng)
    if not any(weight > 0 for weight in live.values()):
        waiting = sorted(arm for arm, weight in weights.items() if weight > 0)
        raise ArmNotRunningError(f"no arm with weight > 0 is running (waiting for {waiting})")
    undrained = {arm: weight for arm, weight in live.items() if arm not in drained}
    if any(weight > 0 for weight in undrained.values()):
        live = undrained  # a drain never leaves the split empty
    selected_by = SELECTED_BY_STICKY if sticky_key else SELECTED_BY_WEIGHT

    def pick(among: Mapping[str, float]) -> str:
        return sticky_arm(sticky_key, among, salt) if sticky_key else random_arm(among, rng)

    first = pick(weights)
    if first in live:
        return Selection(first, selected_by)
    # For a sticky key this is its best-scoring running arm: the other arms keep their keys.
    return Selection(pick(live), selected_by, fallback_from=first)


def _among_able(
    live: Mapping[str, float],
    able: Collection[str],
    drained: Collection[str],
    sticky_key: str | None,
    salt: bytes,
    rng: random.Random | None,
) -> Selection:
    candidates = {arm: weight for arm, weight in live.items() if arm in able}
    if not candidates:
        raise NoAbleArmError("no running arm can serve it")
    undrained = {arm: weight for arm, weight in candidates.items() if arm not in drained}
    candidates = undrained or candidates
    if not any(weight > 0 for weight in candidates.values()):
        candidates = dict.fromkeys(candidates, 1.0)
    arm = sticky_arm(sticky_key, candidates, salt) if sticky_key else random_arm(candidates, rng)
    return Selection(arm, SELECTED_BY_CAPABILITY)
