"""Paired bootstrap confidence intervals over prompts.

Two things measured on the same prompts (two arms, two drafters) are compared by resampling
prompt indices, so each resample keeps both sides on the same prompts and their shared
difficulty cancels out of the ratio.
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
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, low, high) of `statistic` over rows of `samples` (one row per prompt).

    `statistic` maps an array of resampled rows, shape (resamples, n, columns), to one value
    per resample; it is also applied to the sample itself for the point estimate."""
    n = len(samples)
    if n == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    resampled = samples[rng.integers(0, n, size=(RESAMPLES, n))]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(statistic(resampled), [tail, 100 - tail])
    return float(statistic(samples[None])[0]), float(low), float(high)
