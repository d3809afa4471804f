"""How often `ab report` would have called a difference between two identical arms: its looks,
replayed from Prometheus over a finished A/A (two arms that differ in nothing that matters, as
docs/bench/aa-shared-core.yaml serves them).

Experiments begin every `--every-s` seconds of the traffic. Each is read as `ab report --watch`
and the loop read it: a look every `--look-s` seconds for up to `--span-s`. At each look, two
intervals of the per-user tokens/s difference, each behind the report's gates (`--min-requests`,
8 groups of units, no sample-ratio mismatch):

- `two_way`: the report's verdict (intervals over groups of units and windows of time, and no
  verdict before MIN_WINDOWS windows);
- `units`: the interval over groups of units alone, the report's before drift was measured.

An experiment in which any look calls a difference is a false positive. The experiments overlap
and share the node's drift, so they are not independent: the share is what this run shows, not
a calibrated rate (`bench.ab_false_positives` simulates many).

    python -m specserve.bench.aa_replay --arm eagle3.1-twin --baseline eagle3.1 \\
        --start 1765000000 --end 1765001440 --out replay.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from specserve.ab import report
from specserve.ab.prometheus import ArmTotals, Prometheus
from specserve.ab.sequential import Clustered

METHODS = ("two_way", "units")


def called(row: dict, method: str, options: report.Options) -> bool:
    """Whether the look calls a difference: the report's verdict, or for `units` its interval
    behind the same gates but the windows'."""
    if method == "two_way":
        return row["verdict"] in (report.PROMOTE, report.ROLL_BACK)
    difference = row["tokens_per_s"]["difference"]
    return (
        not row["traffic"]["mismatch"]
        and row["requests"] >= options.min_requests
        and (row["unit_groups"] or 0) >= options.min_unit_groups
        and (difference["low"] > 0 or difference["high"] < 0)
    )


def units_alone(arms: dict[str, ArmTotals]) -> dict[str, ArmTotals]:
    """The arms with every window of their cells taken as one: groups of units alone."""
    return {
        name: replace(
            totals,
            clustered={
                stat: Clustered(tuple((group, 0, n, total) for group, _, n, total in found.cells))
                for stat, found in totals.clustered.items()
            },
        )
        for name, totals in arms.items()
    }


def replay(
    prom: Prometheus,
    model: str,
    arm: str,
    options: report.Options,
    since: float,
    until: float,
    look_s: float,
) -> dict[str, dict | None]:
    """Per method, the first look that called a difference (its time from the start, the
    relative difference and interval), else None."""
    first: dict[str, dict | None] = dict.fromkeys(METHODS)
    now = since + look_s
    while now <= until and any(found is None for found in first.values()):
        windowed = prom.totals(model, since, now, report.window_s(now - since))
        for method in METHODS:
            if first[method] is not None:
                continue
            arms = windowed if method == "two_way" else units_alone(windowed)
            rows = report.compare(arms, {}, {}, options)
            row = next((r for r in rows["arms"] if r["arm"] == arm), None)
            if row is not None and called(row, method, options):
                d = row["tokens_per_s"]["difference"]
                first[method] = {
                    "after_s": now - since,
                    "requests": row["requests"],
                    "relative": d["relative"],
                    "relative_low": d["relative_low"],
                    "relative_high": d["relative_high"],
                }
        now += look_s
    return first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--model", help="served model name (default: the only one)")
    parser.add_argument("--arm", required=True, help="the arm read against the baseline")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--start", type=float, required=True, help="traffic's start, Unix time")
    parser.add_argument("--end", type=float, required=True, help="traffic's end, Unix time")
    parser.add_argument("--every-s", type=float, default=60, help="between experiments' starts")
    parser.add_argument("--span-s", type=float, default=600, help="an experiment's longest run")
    parser.add_argument("--look-s", type=float, default=30, help="between looks (the loop's)")
    parser.add_argument("--min-requests", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write the experiments as JSON here")
    args = parser.parse_args(argv)
    prom = Prometheus(args.prometheus)
    model = args.model or prom.model(args.end)
    options = report.Options(baseline=args.baseline, min_requests=args.min_requests)
    starts = []
    since = args.start
    while since + 2 * args.look_s <= args.end:
        starts.append(since)
        since += args.every_s
    experiments = []
    for since in tqdm(starts, desc="experiments"):
        until = min(args.end, since + args.span_s)
        first = replay(prom, model, args.arm, options, since, until, args.look_s)
        experiments.append({"since": since, "until": until, "first": first})
    print(
        f"{len(experiments)} experiments of up to {args.span_s:.0f} s, a look every "
        f"{args.look_s:.0f} s; {args.arm} against {args.baseline}"
    )
    print("| interval | experiments calling a difference | first call (s, relative, CI) |")
    print("| --- | --- | --- |")
    for method in METHODS:
        calls = [e["first"][method] for e in experiments if e["first"][method] is not None]
        shown = "; ".join(
            f"{c['after_s']:.0f} s {c['relative']:+.1%} ({c['relative_low']:+.1%} to "
            f"{c['relative_high']:+.1%})"
            for c in calls[:4]
        )
        print(f"| {method} | {len(calls)} of {len(experiments)} | {shown or '-'} |")
    if args.out:
        args.out.write_text(json.dumps({"arm": args.arm, "experiments": experiments}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
