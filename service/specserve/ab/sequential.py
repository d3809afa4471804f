"""Always-valid confidence intervals for a difference of means: the normal-mixture sequential
probability ratio test (mSPRT).

An operator watching a live A/B split looks whenever they like. A fixed-sample 95% interval
checked again after every batch of requests excludes a true zero difference far more often than
5% of the time (`python -m specserve.bench.ab_false_positives` measures by how much). The mSPRT
interval holds at every look at once: the chance that it *ever* excludes the true difference,
over the whole experiment and however often it is read, is at most alpha.

  Johari, Koomen, Pekelis, Walsh. "Always Valid Inference: Continuous Monitoring of A/B Tests."
  Operations Research 70(3), 2022 (the method, as used for A/B testing).
  Robbins. "Statistical methods related to the law of the iterated logarithm." Ann. Math.
  Statist. 41(5), 1970 (the normal mixture).

For an estimate d of a difference with variance v, mixing the alternative over N(0, tau^2) gives
the likelihood ratio sqrt(v / (v + tau^2)) * exp(tau^2 d^2 / (2 v (v + tau^2))); the interval is
every difference that ratio does not reject at 1 / alpha. It is exact for normal data of known
variance; with the variances estimated from the data, as here, it holds asymptotically
(Waudby-Smith, Arnold, Wu, Wang, Ramdas. "Time-uniform central limit theory and asymptotic
confidence sequences." Ann. Statist. 52(6), 2024). tau only trades width early against width
late: the interval is narrowest when the difference is about tau.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Moments:
    """Count, sum and sum of squares of one arm's per-request observations."""

    n: float
    total: float
    squares: float

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n > 0 else math.nan

    @property
    def variance(self) -> float:
        """Sample variance (n - 1 in the denominator); 0 for a constant."""
        if self.n < 2:
            return math.nan
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))

    @classmethod
    def constant(cls, value: float) -> Moments:
        """A figure known exactly (e.g. acceptance length 1 of an arm that does not draft)."""
        return cls(n=math.inf, total=value, squares=0.0)

    @property
    def is_constant(self) -> bool:
        return math.isinf(self.n)

    def variance_of_mean(self) -> float:
        return 0.0 if self.is_constant else self.variance / self.n

    def value(self) -> float:
        return self.total if self.is_constant else self.mean


# Fewer groups of either kind than this give a two-way variance no better than a guess.
MIN_CLUSTERS = 4


@dataclass(frozen=True)
class Clustered:
    """One arm's per-request observations summed per cell, a cell being a group of randomisation
    units in one window of time: (group, window, count, sum). Its mean holds however a unit's
    requests correlate, and however requests close in time do.

    Requests of one user share the user's speed, prompts and drafter luck; requests close in
    time share their engine's batch and the node's other work (on a loaded node an arm's
    per-user speed drifts: `python -m specserve.bench.speed_drift`). Counted as independent,
    either makes intervals too narrow. The mean is a ratio (all sums over all counts); its
    variance is the cluster-robust (CR1) sandwich over the groups of units where every cell is
    in one window, and two-way over units and windows where the cells span several (Cameron,
    Gelbach, Miller. "Robust Inference With Multiway Clustering." J. Business & Economic
    Statistics 29(2), 2011; the one-way sandwich: Cameron, Miller. "A Practitioner's Guide to
    Cluster-Robust Inference." J. Human Resources 50(2), 2015)."""

    cells: tuple[tuple[str, int, float, float], ...]

    @classmethod
    def of_groups(cls, groups: Iterable[tuple[float, float]]) -> Clustered:
        """(count, sum) per group of units, all in one window."""
        return cls(tuple((str(i), 0, count, total) for i, (count, total) in enumerate(groups)))

    @property
    def n(self) -> float:
        return sum(count for _, _, count, _ in self.cells)

    @property
    def clusters(self) -> int:
        """Groups of units with requests."""
        return len({group for group, _, count, _ in self.cells if count > 0})

    @property
    def windows(self) -> int:
        """Windows of time with requests."""
        return len({window for _, window, count, _ in self.cells if count > 0})

    is_constant = False

    def value(self) -> float:
        n = self.n
        return sum(total for _, _, _, total in self.cells) / n if n > 0 else math.nan

    def variance_of_mean(self) -> float:
        return clustered_variance(((self, 1.0),))


def clustered_variance(parts: Iterable[tuple[Clustered, float]]) -> float:
    """Variance of sum(sign * mean) over the (arm, sign) parts, by the arms' cells.

    Each request's share of the estimate is sign * (value - its arm's mean) / its arm's count,
    summed per cell. Groups of units are the arm's own (different arms' users are different
    users); a window is shared by the arms, so that engines which slow each other down (two on
    one core: when one is fast the other is slow) count as they move. One window: one-way over
    the groups of units. Several: V_units + V_windows - V_cells (taken as the larger one-way
    variance where that is larger: the sum can fall below either), times df / (df - 2) for
    df = one less than the fewer of groups and windows, the variance of Student's t against the
    normal the always-valid interval assumes: a few windows estimate the variance loosely. Too
    few of either (MIN_CLUSTERS): nan."""
    units: dict[tuple[int, str], float] = defaultdict(float)
    windows: dict[int, float] = defaultdict(float)
    cells: dict[tuple[int, str, int], float] = defaultdict(float)
    for index, (arm, sign) in enumerate(parts):
        n, mean = arm.n, arm.value()
        for group, window, count, total in arm.cells:
            if count <= 0:
                continue
            share = sign * (total - mean * count) / n
            units[index, group] += share
            windows[window] += share
            cells[index, group, window] += share
    if len(windows) <= 1:
        return _sandwich(units.values())
    fewer = min(len(units), len(windows))
    if fewer < MIN_CLUSTERS:
        return math.nan
    by_units, by_windows = _sandwich(units.values()), _sandwich(windows.values())
    both = by_units + by_windows - _sandwich(cells.values())
    df = fewer - 1
    return max(both, by_units, by_windows) * df / (df - 2)


def _sandwich(shares: Collection[float]) -> float:
    """G / (G - 1) * the sum of the squared shares of G clusters; nan for fewer than 2."""
    g = len(shares)
    if g < 2:
        return math.nan
    return g / (g - 1) * sum(share * share for share in shares)


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def mixture_half_width(variance: float, tau: float, alpha: float) -> float:
    """Half the width of the always-valid (1 - alpha) interval of an estimate with `variance`."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if variance <= 0:
        return 0.0
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    spread = variance + tau * tau
    return math.sqrt(
        variance * spread / (tau * tau) * (2 * math.log(1 / alpha) + math.log(spread / variance))
    )


def difference(
    treatment: Moments | Clustered,
    baseline: Moments | Clustered,
    *,
    alpha: float,
    relative_tau: float,
) -> Interval:
    """Always-valid interval of mean(treatment) - mean(baseline).

    tau is `relative_tau` times the baseline's mean (the interval is tuned to detect
    differences of about that share)."""
    estimate = treatment.value() - baseline.value()
    if isinstance(treatment, Clustered) and isinstance(baseline, Clustered):
        # One variance over both arms' cells: their windows of time are the same.
        variance = clustered_variance(((treatment, 1.0), (baseline, -1.0)))
    else:
        variance = treatment.variance_of_mean() + baseline.variance_of_mean()
    if math.isnan(variance):
        return Interval(estimate, -math.inf, math.inf)
    tau = relative_tau * abs(baseline.value()) or 1.0
    half = mixture_half_width(variance, tau, alpha)
    return Interval(estimate, estimate - half, estimate + half)


def fixed_sample_difference(
    treatment: Moments | Clustered, baseline: Moments | Clustered, *, z: float
) -> Interval:
    """The ordinary normal interval, valid only when read once at a size fixed in advance
    (for comparison in the false-positive benchmark, never for verdicts)."""
    estimate = treatment.value() - baseline.value()
    half = z * math.sqrt(treatment.variance_of_mean() + baseline.variance_of_mean())
    return Interval(estimate, estimate - half, estimate + half)
