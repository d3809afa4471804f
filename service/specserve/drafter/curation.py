"""What `drafter adapt` learns from, of what was captured: no near-duplicate twice, and no API
key more than its share.

Captured traffic is whatever clients sent. One script repeating a template with a varied slot,
or one tenant sending most of the requests, would otherwise make the drafter that tenant's, and
its verdict too (the held-out slice comes from the same rows). So before the split:

- **Near-duplicates** go: a sequence (prompt and answer) whose token 4-grams overlap an earlier
  kept one's by `NEAR_DUPLICATE_JACCARD` or more is dropped. Found by MinHash with banded
  locality-sensitive hashing (candidates share a band of the signature), then confirmed on the
  exact 4-gram sets; linear in the rows, not quadratic.
- **One key's share** is capped: where the records name two keys or more, no key keeps more than
  `max_key_share` of the rows kept (its newest rows are the ones kept). Rows without a key (keys
  off, or captured before records carried one) are not capped and count in the total.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

SHINGLE = 4  # tokens per n-gram
NEAR_DUPLICATE_JACCARD = 0.8
BANDS, ROWS_PER_BAND = 16, 4  # 64 MinHash values; a pair at 0.8 shares a band with p > 0.999
# Multiply-shift hashing of 32-bit shingle hashes, one (odd a, b) per MinHash value: the high
# 32 bits of a * h + b modulo 2^64 (numpy's uint64 arithmetic wraps).
_RNG = np.random.default_rng(20261128)
_A = _RNG.integers(0, 1 << 62, BANDS * ROWS_PER_BAND, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_B = _RNG.integers(0, 1 << 62, BANDS * ROWS_PER_BAND, dtype=np.uint64)


def shingles(tokens: Sequence[int]) -> frozenset[int]:
    """The sequence's token 4-grams, hashed (a short sequence is one shingle of itself)."""
    if len(tokens) < SHINGLE:
        return frozenset({hash(tuple(tokens))})
    return frozenset(hash(tuple(tokens[i : i + SHINGLE])) for i in range(len(tokens) - 3))


def _signature(found: frozenset[int]) -> np.ndarray:
    hashes = np.fromiter((h & 0xFFFFFFFF for h in found), dtype=np.uint64, count=len(found))
    mixed = (_A[:, None] * hashes[None, :] + _B[:, None]) >> np.uint64(32)
    return mixed.min(axis=1)


def jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Token sequences kept so far, found again by near-duplicates: MinHash signatures banded
    into buckets (candidates share a band), confirmed on the exact shingle sets."""

    def __init__(self, threshold: float = NEAR_DUPLICATE_JACCARD) -> None:
        self.threshold = threshold
        self._buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
        self._shingles: list[frozenset[int]] = []

    @staticmethod
    def _bands(found: frozenset[int]) -> list[tuple[int, bytes]]:
        signature = _signature(found)
        return [
            (band, signature[band * ROWS_PER_BAND : (band + 1) * ROWS_PER_BAND].tobytes())
            for band in range(BANDS)
        ]

    def matches(self, tokens: Sequence[int]) -> bool:
        """Whether a kept sequence's shingles overlap `tokens`' by the threshold or more."""
        found = shingles(tokens)
        candidates = {i for band in self._bands(found) for i in self._buckets.get(band, ())}
        return any(jaccard(found, self._shingles[i]) >= self.threshold for i in candidates)

    def add(self, tokens: Sequence[int]) -> None:
        found = shingles(tokens)
        for band in self._bands(found):
            self._buckets[band].append(len(self._shingles))
        self._shingles.append(found)


def drop_near_duplicates(
    rows: list[dict], threshold: float = NEAR_DUPLICATE_JACCARD
) -> tuple[list[dict], int]:
    """`rows` (oldest first) without any whose sequence is a near-duplicate of an earlier kept
    one; -> (kept, how many dropped)."""
    index = NearDuplicates(threshold)
    kept: list[dict] = []
    for row in rows:
        tokens = [*row["prompt_token_ids"], *row["output_token_ids"]]
        if index.matches(tokens):
            continue
        index.add(tokens)
        kept.append(row)
    return kept, len(rows) - len(kept)


def key_cap(counts: dict[str, int], unkeyed: int, share: float) -> int:
    """The most rows any key keeps: the largest c with c <= share * (unkeyed + sum of
    min(n, c)). The right side grows ever more slowly with c, so the c that satisfy it are
    0..c*, found by bisection."""
    low, high = 0, max(counts.values(), default=0)
    while low < high:
        mid = (low + high + 1) // 2
        if mid <= share * (unkeyed + sum(min(n, mid) for n in counts.values())):
            low = mid
        else:
            high = mid - 1
    return low


def cap_key_share(rows: list[dict], share: float | None) -> tuple[list[dict], dict[str, int]]:
    """`rows` (oldest first) with no key over `share` of them (module docstring); -> (kept, rows
    dropped per key). None, or records naming fewer than two keys: nothing is capped."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row.get("key") is not None:
            by_key[row["key"]].append(i)
    if share is None or len(by_key) < 2:
        return rows, {}
    unkeyed = len(rows) - sum(len(found) for found in by_key.values())
    cap = key_cap({key: len(found) for key, found in by_key.items()}, unkeyed, share)
    dropped = {key: len(found) - cap for key, found in by_key.items() if len(found) > cap}
    # A key over its share keeps its newest rows.
    out = {i for key in dropped for i in by_key[key][: dropped[key]]}
    return [row for i, row in enumerate(rows) if i not in out], dropped
