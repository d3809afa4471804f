"""How often a continuously watched A/B comparison declares a difference that is not there.

Simulates experiments of two arms, reading the comparison after every `--look-every` requests
per arm as an operator running `specserve ab report --watch` would, with per-request tokens/s
drawn from a skewed (log-normal) distribution like real per-user speeds. Counts experiments in
which any look excluded zero: for two identical arms that is a false positive; for an arm slower
by `--effect` it is a detection (power), reported with the requests it took. The always-valid
interval (mixture SPRT, the one `ab report` uses) is compared with the ordinary fixed-sample
interval read at the same looks.

With `--users U`, each arm's requests come from U users (sticky: a user stays in one arm) who
send very different numbers of requests (Zipf) at speeds of their own: the requests are no longer
independent. The always-valid interval taken per request then sees a difference that is not
there far more often than alpha; taken over the groups of users the router records
(metrics.UNIT_BUCKETS buckets by the user's hash, cluster-robust: what `ab report` does) it holds.

With `--drift D`, a share D of each request's log-speed variance is its arm's engine state,
which moves slowly from one request of the arm to the next (an AR(1) series, correlation
`--drift-rho` between consecutive requests, one every SPACING_S seconds per arm): requests close
in time share their engine's batch, as they do on a loaded CPU node. `--drift-coupling` is the
correlation of the two arms' states at the same moment (negative for two engines on one core:
when one is fast the other is slow; -0.75 measured, BENCHMARKS.md). No grouping of users absorbs
drift; the report's intervals, two-way over groups of units and windows of time, do.

    python -m specserve.bench.ab_false_positives --experiments 1000
    python -m specserve.bench.ab_false_positives --experiments 1000 --users 60
    python -m specserve.bench.ab_false_positives --requests 200 --look-every 15 --drift 0.25 \
        --drift-coupling -0.75
"""

from __future__ import annotations

import argparse
import math
import statistics
from statistics import NormalDist

import numpy as np
from tqdm import tqdm

from specserve.ab import report
from specserve.ab.sequential import Clustered, Moments, difference, fixed_sample_difference
from specserve.metrics import UNIT_BUCKETS

# The intervals compared: the report's (always-valid, two-way over groups of units and windows
# of time), the same over groups of units alone (the report's before drift was measured), the
# always-valid one per request (right only for independent requests) and the fixed-sample one
# per request.
METHODS = ("two_way", "clustered", "always_valid", "fixed_sample")
# Seconds between an arm's requests (each arm got ~0.5 requests/s in the live measurements).
SPACING_S = 2.0


class _Arm:
    """One simulated arm's requests: their values, units' buckets and times, and running sums."""

    def __init__(self, values: np.ndarray, buckets: np.ndarray, offset_s: float) -> None:
        self.values, self.buckets = values, buckets
        self.times = offset_s + SPACING_S * np.arange(len(values))
        self.sums, self.squares = np.cumsum(values), np.cumsum(values * values)

    def per_request(self, n: int) -> Moments:
        return Moments(n, float(self.sums[n - 1]), float(self.squares[n - 1]))

    def cells(self, n: int, now: float, window_s: float | None) -> Clustered:
        """The first n requests per group of units, and per window of time as `ab report`
        cuts (0, now] (windows of `window_s` back from now; None: one window)."""
        window = np.zeros(n, dtype=int)
        if window_s is not None:
            step = math.ceil(window_s)
            first = now - (math.ceil(now / step) - 1) * step
            window = np.maximum(0, np.ceil((self.times[:n] - first) / step)).astype(int)
        cells: dict[tuple[int, int], list[float]] = {}
        for bucket, w, value in zip(self.buckets[:n], window, self.values[:n], strict=True):
            cell = cells.setdefault((int(bucket), int(w)), [0.0, 0.0])
            cell[0] += 1
            cell[1] += float(value)
        return Clustered(tuple((str(b), w, c, t) for (b, w), (c, t) in cells.items()))


def first_detection(
    a: _Arm, b: _Arm, requests: int, look_every: int, alpha: float, tau: float, method: str
) -> int | None:
    """Requests per arm at the first look whose interval excludes 0, else None."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    for n in range(look_every, requests + 1, look_every):
        now = n * SPACING_S
        if method == "two_way":
            window = report.window_s(now)
            mine, theirs = b.cells(n, now, window), a.cells(n, now, window)
            if min(mine.windows, theirs.windows) < report.MIN_WINDOWS:
                continue
            interval = difference(mine, theirs, alpha=alpha, relative_tau=tau)
        elif method == "clustered":
            mine, theirs = b.cells(n, now, None), a.cells(n, now, None)
            interval = difference(mine, theirs, alpha=alpha, relative_tau=tau)
        elif method == "always_valid":
            interval = difference(b.per_request(n), a.per_request(n), alpha=alpha, relative_tau=tau)
        else:
            interval = fixed_sample_difference(b.per_request(n), a.per_request(n), z=z)
        if interval.excludes_zero:
            return n
    return None


def engine_state(rng: np.random.Generator, requests: int, rho: float) -> np.ndarray:
    """A stationary unit-variance AR(1) series over an arm's consecutive requests."""
    steps = rng.standard_normal(requests) * np.sqrt(1 - rho * rho)
    state = np.empty(requests)
    state[0] = rng.standard_normal()
    for i in range(1, requests):
        state[i] = rho * state[i - 1] + steps[i]
    return state


def engine_states(
    rng: np.random.Generator, requests: int, rho: float, coupling: float
) -> tuple[np.ndarray, np.ndarray]:
    """Two arms' engine states (`engine_state`), correlated `coupling` at the same moment."""
    first = engine_state(rng, requests, rho)
    own = engine_state(rng, requests, rho)
    return first, coupling * first + math.sqrt(1 - coupling * coupling) * own


def draw_arm(
    rng: np.random.Generator,
    mean: float,
    sigma: float,
    users: int | None,
    state: np.ndarray,
    drift: float = 0.0,
    offset_s: float = 0.0,
) -> _Arm:
    """Per-request tokens/s, one request per value of `state`: independent requests; or
    requests of `users` users, the k-th busiest sending ~1/k of the traffic, each user at a
    speed of its own (log-normal, spread `sigma` like the requests around it) and hashed to a
    bucket. A share `drift` of the requests' log-variance follows the arm's engine `state`."""
    requests = len(state)
    own = rng.standard_normal(requests) * np.sqrt(1 - drift)
    noise = np.exp(sigma * (own + state * np.sqrt(drift)))
    if users is None:
        return _Arm(mean * noise, rng.integers(0, UNIT_BUCKETS, requests), offset_s)
    frequency = 1 / np.arange(1, users + 1)
    user = rng.choice(users, size=requests, p=frequency / frequency.sum())
    speed = rng.lognormal(0, sigma, users)
    bucket = rng.integers(0, UNIT_BUCKETS, users)
    return _Arm(mean * speed[user] * noise, bucket[user], offset_s)


def simulate(
    experiments: int,
    requests: int,
    look_every: int,
    effect: float,
    alpha: float = 0.05,
    tau: float = 0.1,
    seed: int = 0,
    progress: bool = False,
    users: int | None = None,
    drift: float = 0.0,
    drift_rho: float = 0.9,
    drift_coupling: float = 0.0,
    methods: tuple[str, ...] = METHODS,
) -> dict[str, dict[str, float]]:
    """Share of experiments with a detection, and the median requests it took, for each of
    METHODS. Arm B's mean is (1 - effect) times A's; `users` per arm (None: every request
    independent); `drift` as in `draw_arm`, the states as `engine_states` draws them; `methods`:
    those of METHODS to read."""
    rng = np.random.default_rng(seed)
    sigma = 0.5
    found: dict[str, list[int | None]] = {method: [] for method in methods}
    for _ in tqdm(range(experiments), disable=not progress, desc="experiments"):
        states = engine_states(rng, requests, drift_rho, drift_coupling)
        a = draw_arm(rng, 30, sigma, users, states[0], drift)
        b = draw_arm(rng, 30 * (1 - effect), sigma, users, states[1], drift, SPACING_S / 2)
        for method in found:
            found[method].append(first_detection(a, b, requests, look_every, alpha, tau, method))
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
    parser.add_argument(
        "--users",
        type=int,
        help="users per arm, each sending many requests (default: every request independent)",
    )
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="share of the log-speed variance that is the arm's slowly moving engine state",
    )
    parser.add_argument(
        "--drift-rho", type=float, default=0.9, help="its correlation between consecutive requests"
    )
    parser.add_argument(
        "--drift-coupling",
        type=float,
        default=0.0,
        help="correlation of the two arms' states at one moment (negative: they share a core)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.drift < 1 or not 0 <= args.drift_rho < 1:
        parser.error("--drift and --drift-rho are in [0, 1)")
    if not -1 <= args.drift_coupling <= 1:
        parser.error("--drift-coupling is in [-1, 1]")
    senders = f"{args.users} users per arm" if args.users else "independent requests"
    drifting = (
        f", {args.drift:.0%} of it drifting (rho {args.drift_rho}, coupling {args.drift_coupling})"
        if args.drift
        else ""
    )
    print(
        f"{args.experiments} experiments, up to {args.requests} requests per arm from "
        f"{senders}{drifting}, a look every {args.look_every}, alpha {args.alpha}"
    )
    print("| arms | interval | experiments with a detection | median requests to it |")
    print("| --- | --- | --- | --- |")
    for effect, label in ((0.0, "identical (false positives)"), (args.effect, "")):
        label = label or f"B {args.effect:.0%} slower (power)"
        result = simulate(
            args.experiments,
            args.requests,
            args.look_every,
            effect,
            args.alpha,
            progress=True,
            users=args.users,
            drift=args.drift,
            drift_rho=args.drift_rho,
            drift_coupling=args.drift_coupling,
        )
        for method, figures in result.items():
            print(
                f"| {label} | {method.replace('_', '-')} | {figures['detected']:.1%} | "
                f"{figures['median_requests']:.0f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
