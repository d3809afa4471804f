"""How much an arm's per-request speed drifts with time: what the A/B intervals assume away.

The A/B report treats an arm's requests as independent within each group of randomisation units.
On a loaded node, requests close in time share their engine's batch and the node's other work,
so their per-user tokens/s move together, and an interval that ignores that is too narrow
(`bench.ab_false_positives --drift`). This sends a domain's chat traffic through the router
(each request a new user, so the weights split it), records each request's arm (the response's
arm header) and tokens/s as the router counts it (output tokens over the request's latency), and
per arm, in the order the requests were sent, reports:

- the autocorrelation of the speeds at a few lags (0 for independent requests);
- the variance inflation of the arm's mean: the variance of the means of consecutive blocks of
  b requests, times b, over the requests' variance (1 for independent requests; an interval
  over independent requests is sqrt(inflation) times too narrow).

    SPECSERVE_CONFIG=docs/bench/aa-shared-core.yaml specserve serve &
    python -m specserve.bench.speed_drift --users 8 --minutes 8 --out drift/
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from specserve.bench.loop_proof import Sample, Traffic

LAGS = (1, 2, 4, 8)
BLOCKS = (5, 10, 20)


def autocorrelation(values: list[float], lag: int) -> float:
    mean = statistics.fmean(values)
    centred = [v - mean for v in values]
    total = sum(c * c for c in centred)
    if lag >= len(values) or total == 0:
        return float("nan")
    return sum(centred[i] * centred[i + lag] for i in range(len(values) - lag)) / total


def variance_inflation(values: list[float], block: int) -> float:
    """Variance of consecutive blocks' means times `block`, over the values' variance (nan with
    fewer than 3 whole blocks)."""
    means = [
        statistics.fmean(values[i : i + block]) for i in range(0, len(values) - block + 1, block)
    ]
    if len(means) < 3 or statistics.variance(values) == 0:
        return float("nan")
    return statistics.variance(means) * block / statistics.variance(values)


def drift_figures(samples: list[Sample]) -> dict[str, dict]:
    """Per arm, in the order sent: n, mean tokens/s, autocorrelation per lag, inflation per
    block size."""
    by_arm: dict[str, list[Sample]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: s.started):
        by_arm[sample.arm].append(sample)
    figures = {}
    for arm, own in sorted(by_arm.items()):
        speeds = [s.tokens_per_s for s in own]
        figures[arm] = {
            "requests": len(speeds),
            "mean_tokens_per_s": statistics.fmean(speeds),
            "autocorrelation": {lag: autocorrelation(speeds, lag) for lag in LAGS},
            "variance_inflation": {block: variance_inflation(speeds, block) for block in BLOCKS},
        }
    return figures


def markdown(figures: dict[str, dict]) -> str:
    lags = " | ".join(f"lag {lag}" for lag in LAGS)
    blocks = " | ".join(f"inflation, blocks of {b}" for b in BLOCKS)
    lines = [
        f"| arm | requests | tokens/s per user | {lags} | {blocks} |",
        "| --- " * (3 + len(LAGS) + len(BLOCKS)) + "|",
    ]
    for arm, f in figures.items():
        cells = [f"{f['autocorrelation'][lag]:.2f}" for lag in LAGS]
        cells += [f"{f['variance_inflation'][b]:.1f}" for b in BLOCKS]
        lines.append(
            f"| {arm} | {f['requests']} | {f['mean_tokens_per_s']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--domain", default="tickets", help="traffic: tickets, extraction, ...")
    parser.add_argument("--users", type=int, default=8, help="requests in flight")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--out", type=Path, default=Path("speed-drift"))
    args = parser.parse_args(argv)
    traffic = Traffic(args.url, args.api_key, args.domain, args.max_tokens, args.users)
    traffic.start(args.users)
    try:
        time.sleep(args.minutes * 60)
    finally:
        traffic.stop()  # the requests in flight finish
    samples, failed = traffic.samples, traffic.failed
    figures = drift_figures(samples)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "users": args.users,
        "minutes": args.minutes,
        "failed": failed,
        "figures": figures,
        "samples": [asdict(s) for s in samples],
    }
    (args.out / "drift.json").write_text(json.dumps(report, indent=1))
    print(f"{len(samples)} requests, {failed} failed")
    print(markdown(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
