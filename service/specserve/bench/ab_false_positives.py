"""How often a continuously watched A/B comparison declares a difference that is not there.

Simulates experiments of two arms, reading the comparison after every `--look-every` requests
per arm as an operator running `specserve ab report --watch` would, with per-request tokens/s
drawn from a skewed (log-normal) distribution like real per-user speeds. Counts experiments in
which any look excluded zero: for two identical arms that is a false positive; for an arm slower
by `--effect` it is a detection (power), reported with the requests it took. The always-valid
interval (mixture SPRT, the one `ab report` uses) is compared with the ordinary fixed-sample
interval read at the same looks.

    python -m specserve.bench.ab_false_positives --experiments 1000
"""

from __future__ import annotations

import argparse
import statistics
from statistics import NormalDist

import numpy as np
from tqdm import tqdm

from specserve.ab.sequential import Moments, difference, fixed_sample_difference


def first_detection(
    a: np.ndarray, b: np.ndarray, look_every: int, alpha: float, tau: float, always_valid: bool
) -> int | None:
    """Requests per arm at the first look whose interval excludes 0, else None."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    sums_a, sums_b = np.cumsum(a), np.cumsum(b)
    squares_a, squares_b = np.cumsum(a * a), np.cumsum(b * b)
    for n in range(look_every, len(a) + 1, look_every):
        i = n - 1
        arm_b = Moments(n, float(sums_b[i]), float(squares_b[i]))
        arm_a = Moments(n, float(sums_a[i]), float(squares_a[i]))
        if always_valid:
            interval = difference(arm_b, arm_a, alpha=alpha, relative_tau=tau)
        else:
            interval = fixed_sample_difference(arm_b, arm_a, z=z)
        if interval.excludes_zero:
            return n
    return None


def simulate(
    experiments: int,
    requests: int,
    look_every: int,
    effect: float,
    alpha: float = 0.05,
    tau: float = 0.1,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, dict[str, float]]:
    """Share of experiments with a detection, and the median requests it took, for the
    always-valid and the fixed-sample interval. Arm B's mean is (1 - effect) times A's."""
    rng = np.random.default_rng(seed)
    sigma = 0.5
    found: dict[str, list[int | None]] = {"always_valid": [], "fixed_sample": []}
    for _ in tqdm(range(experiments), disable=not progress, desc="experiments"):
        a = 30 * rng.lognormal(0, sigma, requests)
        b = 30 * (1 - effect) * rng.lognormal(0, sigma, requests)
        for method in found:
            found[method].append(
                first_detection(a, b, look_every, alpha, tau, method == "always_valid")
            )
    out = {}
    for method, firsts in found.items():
        hits = [n for n in firsts if n is not None]
        out[method] = {
            "detected": len(hits) / experiments,
            "median_requests": statistics.median(hits) if hits else float("nan"),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=2000, help="per arm, at most")
    parser.add_argument("--look-every", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--effect", type=float, default=0.1, help="slowdown of the worse arm")
    args = parser.parse_args(argv)
    print(
        f"{args.experiments} experiments, up to {args.requests} requests per arm, a look every "
        f"{args.look_every}, alpha {args.alpha}"
    )
    print("| arms | interval | experiments with a detection | median requests to it |")
    print("| --- | --- | --- | --- |")
    for effect, label in ((0.0, "identical (false positives)"), (args.effect, "")):
        label = label or f"B {args.effect:.0%} slower (power)"
        result = simulate(
            args.experiments, args.requests, args.look_every, effect, args.alpha, progress=True
        )
        for method, figures in result.items():
            print(
                f"| {label} | {method.replace('_', '-')} | {figures['detected']:.1%} | "
                f"{figures['median_requests']:.0f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
