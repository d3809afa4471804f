"""Paired bootstrap confidence intervals over prompts.

Two things measured on the same prompts (two arms, two drafters) are compared by resampling
prompt indices, so each resample keeps both sides on the same prompts and their shared
difficulty cancels out of the ratio.

Prompts measured in groups that vary together (a benchmark's rounds: each round's requests
share its start and whatever the machine did meanwhile) are resampled in two stages: the groups
with replacement, then the prompts within each drawn group. Resampling prompts alone would
treat a round that ran slow as many independent slow prompts and give an interval far too
narrow (docs/bench/serving-speed.md, "k from live acceptance").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95


def paired_interval(
    statistic: Callable[[np.ndarray], np.ndarray],
    samples: np.ndarray,
    *,
    groups: np.ndarray | None = None,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, low, high) of `statistic` over rows of `samples` (one row per prompt).

    `statistic` maps an array of resampled rows, shape (resamples, n, columns), to one value
    per resample; it is also applied to the sample itself for the point estimate. With
    `groups` (a label per row) and more than one group, the groups are resampled first."""
    n = len(samples)
    if n == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    if groups is None or len(np.unique(groups)) < 2:
        rows = rng.integers(0, n, size=(RESAMPLES, n))
    else:
        rows = _two_stage_rows(np.asarray(groups), rng)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(statistic(samples[rows]), [tail, 100 - tail])
    return float(statistic(samples[None])[0]), float(low), float(high)


def _two_stage_rows(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(RESAMPLES, n) row indices: each group's slot takes a group drawn with replacement and
    fills its own size with that group's rows, drawn with replacement."""
    order = np.argsort(groups, kind="stable")
    _, starts, sizes = np.unique(groups[order], return_index=True, return_counts=True)
    drawn = rng.integers(0, len(sizes), size=(RESAMPLES, len(sizes)))
    slots = []
    for slot, size in enumerate(sizes):
        group = drawn[:, slot, None]
        offsets = (rng.random((RESAMPLES, size)) * sizes[group]).astype(int)
        slots.append(order[starts[group] + offsets])
    return np.concatenate(slots, axis=1)
