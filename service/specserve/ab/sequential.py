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


@dataclass(frozen=True)
class Clustered:
    """One arm's per-request observations summed per group of randomisation units (count and
    sum per group), for a mean whose variance holds however the units' requests correlate.

    The mean is a ratio (all sums over all counts); its variance is the cluster-robust (CR1)
    sandwich over the G groups: G / (G - 1) * sum_g (sum_g - mean * count_g)^2 / count^2
    (Cameron, Miller. "A Practitioner's Guide to Cluster-Robust Inference." J. Human Resources
    50(2), 2015). Requests of one user share the user's speed, prompts and drafter luck; counted
    as independent they make intervals too narrow, by more the more requests each user sends."""

    groups: tuple[tuple[float, float], ...]  # (count, sum) of each group with requests

    @property
    def n(self) -> float:
        return sum(count for count, _ in self.groups)

    @property
    def clusters(self) -> int:
        return len(self.groups)

    is_constant = False

    def value(self) -> float:
        n = self.n
        return sum(total for _, total in self.groups) / n if n > 0 else math.nan

    def variance_of_mean(self) -> float:
        g = self.clusters
        if g < 2:
            return math.nan
        n, mean = self.n, self.value()
        spread = sum((total - mean * count) ** 2 for count, total in self.groups)
        return g / (g - 1) * spread / (n * n)


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
