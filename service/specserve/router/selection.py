"""Arm selection: override > sticky key > random, all by the configured weights.

Sticky keys use weighted rendezvous hashing: each (key, arm) pair gets a pseudo-random score
`weight / -ln(u)` with `u` uniform in (0, 1) from a hash, and the key goes to the best-scoring arm.
The chance an arm wins is its share of the weights; a key keeps its arm while the weights stay the
same; and when one arm's weight grows, keys only move *to* that arm (when it shrinks, only *from*
it), which is the least movement any scheme can have.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping

_TWO_64 = float(2**64)


class UnknownArmError(LookupError):
    def __init__(self, arm: str, known: list[str]) -> None:
        super().__init__(f"unknown arm {arm!r}; arms: {', '.join(known)}")
        self.arm = arm


def _uniform(key: str, arm: str) -> float:
    digest = hashlib.blake2b(f"{key}\x00{arm}".encode(), digest_size=8).digest()
    # Map to (0, 1): never 0 (log) and never 1 (division by zero).
    return (int.from_bytes(digest, "big") + 0.5) / _TWO_64


def sticky_arm(key: str, weights: Mapping[str, float]) -> str:
    """The arm a sticky key maps to; only arms with weight > 0 can win."""
    best, best_score = "", -1.0
    for arm, weight in weights.items():
        if weight <= 0:
            continue
        score = weight / -math.log(_uniform(key, arm))
        if score > best_score:
            best, best_score = arm, score
    if not best:
        raise ValueError("no arm has weight > 0")
    return best


def random_arm(weights: Mapping[str, float], rng: random.Random | None = None) -> str:
    arms = [arm for arm, weight in weights.items() if weight > 0]
    if not arms:
        raise ValueError("no arm has weight > 0")
    return (rng or random).choices(arms, weights=[weights[a] for a in arms])[0]


def choose_arm(
    weights: Mapping[str, float],
    *,
    override: str | None = None,
    sticky_key: str | None = None,
    rng: random.Random | None = None,
) -> str:
    """Pick the arm for one request. An override may name any configured arm, even weight 0."""
    if override is not None:
        if override not in weights:
            raise UnknownArmError(override, sorted(weights))
        return override
    if sticky_key:
        return sticky_arm(sticky_key, weights)
    return random_arm(weights, rng)
