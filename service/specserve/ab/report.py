"""`specserve ab report`: each arm against a baseline arm on live traffic, read from Prometheus.

Per arm, from the experiment's start (by default when the active config revision appeared) to
now: the traffic it got against its weight, per-user output tokens/s, TPOT (streaming requests)
and mean acceptance length, each as a difference from the baseline with an always-valid
confidence interval (specserve/ab/sequential.py: safe to read at any time, as often as wanted),
a verdict with its reason, the `num_speculative_tokens` its per-position acceptance suggests,
and its speedup per load band.

The unit is the one the router randomised: the sticky key (session header or `user`) where a
request has one, else the request. A user's requests share its speed, prompts and drafter luck,
so they are not independent: the intervals and the sample-ratio check are cluster-robust over the
groups of units the router records (metrics.UNIT_BUCKETS buckets by the unit's hash, a user's
requests all in one), and no verdict is given while an arm's requests come from fewer than
`min_unit_groups` groups (a few heavy users are not a sample). Requests close in time are not
independent either: they share their engine's batch and the node's other work, and on a loaded
node an arm's speed drifts (BENCHMARKS.md, "speed drift"). So the intervals are two-way over
groups of units and windows of time (`window_s`), the windows shared by the arms, and no verdict
is given before the experiment spans MIN_WINDOWS of them. Where the unit series are missing (data
from routers before them) the unit is the request, and the report says so.

Requests whose prompt the config names (routing.ab_left_out_prompts: what a challenger was
trained on) are served but left out of every figure, and counted apart.

Per key too: where two API keys or more sent `min_requests` to both the arm and the baseline,
each key's segment gets its own per-user tokens/s difference, and a promotion is held back
(keep testing) while a segment's estimate is below -`max_key_loss`: one tenant made slower by
more than that is not outvoted by the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve import k_schedule
from specserve.ab.prometheus import ArmTotals, Prometheus, PrometheusError, parse_since
from specserve.ab.sequential import MIN_CLUSTERS, Clustered, Interval, Moments, difference
from specserve.metrics import (
    REQUEST_ACCEPTANCE_LENGTH,
    REQUEST_OUTPUT_SPEED,
    TIME_PER_OUTPUT_TOKEN,
    UNIT_BUCKETS,
)

PROMOTE, KEEP_TESTING, ROLL_BACK = "promote", "keep testing", "roll back"
# The figures compared, the primary (the verdict's) first: (key in the report, metric).
FIGURES = (
    ("tokens_per_s", REQUEST_OUTPUT_SPEED),
    ("tpot_s", TIME_PER_OUTPUT_TOKEN),
    ("acceptance_length", REQUEST_ACCEPTANCE_LENGTH),
)
# Load bands by mean requests in flight: (label, upper bound).
LOAD_BANDS = (("1", 1.5), ("2-4", 4.5), ("5-16", 16.5), (">16", math.inf))
# A traffic share this many standard errors off its weight is a sample-ratio mismatch.
SRM_Z = 4.0
# Windows of time the intervals cluster over: at least MIN_WINDOW_S long (twin arms on one node
# stay correlated for ~20 s, and simulated with that drift, identical arms differ "with
# confidence" at alpha from 30 s windows, twice as often at 20 s: BENCHMARKS.md, "speed
# drift"), at most MAX_WINDOWS of them, and no verdict before MIN_WINDOWS.
MIN_WINDOW_S, MAX_WINDOWS, MIN_WINDOWS = 30.0, 16, MIN_CLUSTERS
# The randomisation units the report names (`unit` in its JSON).
UNIT_STICKY_KEY, UNIT_REQUEST, UNIT_MIXED = "sticky key", "request", "sticky key, else request"


@dataclass(frozen=True)
class Options:
    baseline: str
    alpha: float = 0.05
    relative_tau: float = 0.1
    min_requests: int = 30
    draft_cost: float = 0.1
    # A key segment slower than the baseline by more than this share holds a promotion back.
    max_key_loss: float = 0.1
    # No verdict while an arm's randomized requests fall in fewer groups of units than this.
    min_unit_groups: int = 8
    # `<arm>.json` round costs (bench.round_cost, `specserve tune`): with them the k advisor
    # recommends a k schedule, as `specserve tune` derives it.
    round_costs: Path | None = None


def build_report(prom: Prometheus, options: Options, since: float | None, model: str | None):
    now = time.time()
    model = model or prom.model()
    revision, revision_start = prom.revision_start(model, now)
    start = revision_start if since is None else since
    window = window_s(now - start)
    arms = prom.totals(model, start, now, window)
    if options.baseline not in arms:
        known = ", ".join(sorted(arms)) or "none"
        raise PrometheusError(f"baseline arm {options.baseline!r} has no data (arms: {known})")
    step = max(15.0, (now - start) / 120)
    speed, load = prom.speed_by_load(model, start, now, step)
    return compare(arms, speed, load, options) | {
        "model": model,
        "revision": revision,
        "since": start,
        "now": now,
        "alpha": options.alpha,
        "relative_tau": options.relative_tau,
        "baseline": options.baseline,
        "window_s": window,
    }


def window_s(duration_s: float) -> float:
    """The windows of time an experiment this long is cut into."""
    return max(MIN_WINDOW_S, duration_s / MAX_WINDOWS)


def compare(
    arms: dict[str, ArmTotals],
    speed: dict[str, dict[float, tuple[float, float]]],
    load: dict[float, float],
    options: Options,
) -> dict[str, Any]:
    base = arms[options.baseline]
    weighted = [a for a in arms.values() if a.weight > 0]
    total_weight = sum(a.weight for a in weighted)
    total_randomized = sum(a.randomized for a in weighted)
    by_bucket: dict[str, float] = {}
    for a in weighted:
        for bucket, count in a.selections_by_bucket.items():
            by_bucket[bucket] = by_bucket.get(bucket, 0.0) + count
    rows = []
    shown = {n: a for n, a in arms.items() if a.weight > 0 or _n(a) > 0 or n == options.baseline}
    for name, arm in sorted(shown.items(), key=lambda kv: kv[0] != options.baseline):
        row: dict[str, Any] = {"arm": name, "weight": arm.weight, "requests": _n(arm)}
        row["left_out"] = arm.left_out
        row["unit_groups"] = _unit_groups(arm)
        row["windows"] = _windows(arm)
        if by_bucket:
            row["traffic"] = clustered_traffic_share(arm, total_weight, by_bucket, options)
        else:
            row["traffic"] = traffic_share(arm, total_weight, total_randomized)
        for key, metric in FIGURES:
            mine, theirs = _moments(arm, metric), _moments(base, metric)
            row[key] = None if mine is None else {"mean": mine.value()}
            if mine is not None and theirs is not None and name != options.baseline:
                interval = difference(
                    mine, theirs, alpha=options.alpha, relative_tau=options.relative_tau
                )
                row[key]["difference"] = _interval(interval, theirs.value())
        if name != options.baseline:
            row["by_key"] = key_segments(arm, base, options)
        row["suggested_k"] = suggest_k(arm, options.draft_cost)
        row["suggested_schedule"] = suggest_schedule(name, arm, options.round_costs)
        row["speedup_by_load"] = speedup_by_load(
            speed.get(name, {}), speed.get(options.baseline, {}), load
        )
        if name != options.baseline:
            row["verdict"], row["reason"] = verdict(
                row,
                base_n=_n(base),
                base_groups=_unit_groups(base),
                base_windows=_windows(base),
                options=options,
            )
        rows.append(row)
    return {
        "arms": rows,
        "unit": randomisation_unit(weighted),
        "cluster_robust": any(a.clustered for a in weighted),
    }


def randomisation_unit(arms: list[ArmTotals]) -> str:
    """The unit the router randomised: the sticky key, the request, or both, by how the
    randomized requests were chosen."""
    sticky, randomized = sum(a.sticky for a in arms), sum(a.randomized for a in arms)
    if sticky >= randomized > 0:
        return UNIT_STICKY_KEY
    return UNIT_MIXED if sticky > 0 else UNIT_REQUEST


def _unit_groups(arm: ArmTotals) -> int | None:
    """Groups of units with requests in the arm's primary figure; None without those series."""
    found = arm.clustered.get(REQUEST_OUTPUT_SPEED)
    return found.clusters if found is not None else None


def _windows(arm: ArmTotals) -> int | None:
    """Windows of time with requests in the arm's primary figure; None without those series."""
    found = arm.clustered.get(REQUEST_OUTPUT_SPEED)
    return found.windows if found is not None else None


def key_segments(arm: ArmTotals, base: ArmTotals, options: Options) -> dict[str, Any]:
    """Per-user tokens/s of each key's requests against the baseline's requests of the same
    key, for keys with `min_requests` in both; {} where fewer than two keys qualify (one key's
    segment is the whole arm)."""
    segments = {}
    for key, mine in sorted(arm.by_key.items()):
        theirs = base.by_key.get(key)
        if theirs is None or min(mine.n, theirs.n) < options.min_requests:
            continue
        interval = difference(mine, theirs, alpha=options.alpha, relative_tau=options.relative_tau)
        segments[key] = {"requests": mine.n} | _interval(interval, theirs.value())
    return segments if len(segments) >= 2 else {}


def _moments(arm: ArmTotals, metric: str) -> Moments | Clustered | None:
    """The arm's observations of `metric`: per group of units where recorded, else per request."""
    if metric == REQUEST_ACCEPTANCE_LENGTH and metric not in arm.stats:
        # An arm that does not draft makes one token per engine step, exactly.
        return Moments.constant(1.0) if arm.drafts == 0 and _n(arm) > 0 else None
    return arm.clustered.get(metric) or arm.stats.get(metric)


def _n(arm: ArmTotals) -> float:
    stat = arm.stats.get(REQUEST_OUTPUT_SPEED)
    return stat.n if stat else 0.0


def _interval(interval: Interval, base: float) -> dict[str, float]:
    scale = abs(base) or math.nan
    return {
        "estimate": interval.estimate,
        "low": interval.low,
        "high": interval.high,
        "relative": interval.estimate / scale,
        "relative_low": interval.low / scale,
        "relative_high": interval.high / scale,
    }


def traffic_share(arm: ArmTotals, total_weight: float, total: float) -> dict[str, Any]:
    """The arm's share of randomized (weighted or sticky) traffic against its weight's share;
    `mismatch` when it is further off than sampling explains (sticky keys, fallbacks to other
    arms while this one was not running, or the guardrail draining it)."""
    expected = arm.weight / total_weight if total_weight > 0 else 0.0
    observed = arm.randomized / total if total > 0 else math.nan
    spread = math.sqrt(expected * (1 - expected) / total) if total > 0 else math.nan
    off = abs(observed - expected) / spread if spread and spread > 0 else 0.0
    return {"expected": expected, "observed": observed, "mismatch": bool(off > SRM_Z)}


def clustered_traffic_share(
    arm: ArmTotals, total_weight: float, by_bucket: dict[str, float], options: Options
) -> dict[str, Any]:
    """traffic_share with the units' groups as the sampling unit: the share's cluster-robust
    standard error over the buckets (a heavy user moves the share a lot, and that is no
    mismatch). Too few groups to estimate it: no mismatch is called."""
    expected = arm.weight / total_weight if total_weight > 0 else 0.0
    total = sum(by_bucket.values())
    mine = sum(arm.selections_by_bucket.values())
    observed = mine / total if total > 0 else math.nan
    mismatch = False
    groups = [b for b, count in by_bucket.items() if count > 0]
    if len(groups) >= max(2, options.min_unit_groups):
        g = len(groups)
        spread = sum(
            (arm.selections_by_bucket.get(b, 0.0) - observed * by_bucket[b]) ** 2 for b in groups
        )
        error = math.sqrt(g / (g - 1) * spread) / total
        # Every group split alike (all of it to one side, as a challenger's first seconds can
        # be, or the same share in each) leaves no spread between groups: the requests' own
        # binomial spread is then the least the share can have. 0 of 10 requests at a 25 %
        # share happens one time in 18; 0 of 100 is a mismatch.
        if error == 0:
            error = math.sqrt(expected * (1 - expected) / total)
        if error > 0:
            off = abs(observed - expected) / error
        else:
            off = math.inf if observed != expected else 0.0
        mismatch = bool(off > SRM_Z)
    return {"expected": expected, "observed": observed, "mismatch": mismatch}


def live_chain(arm: ArmTotals) -> list[float]:
    """The chance a draft token at each position is accepted once drafted: accepted over
    drafted at the position (under a k schedule not every draft reaches it), else, for data
    without the drafted counter, over every draft (the same for a fixed k). Positions that
    never accepted a token export no series: they count as 0."""
    if any(arm.drafted_per_position):
        return k_schedule.chain_from_counts(arm.accepted_per_position, arm.drafted_per_position)
    if arm.drafts <= 0:
        return []
    return [accepted / arm.drafts for accepted in arm.accepted_per_position]


def suggest_k(arm: ArmTotals, draft_cost: float) -> dict[str, Any] | None:
    """The k that maximizes expected tokens per verify step over its cost (1 + draft_cost * k:
    a target step plus drafting and verifying k tokens), from the measured acceptance at each
    position; k = 0 (no speculation) makes 1 token per step at cost 1. Positions beyond the
    configured k were never drafted: if the last one still pays its cost, a larger k may too."""
    if arm.drafts <= 0:
        return None
    rates = live_chain(arm)
    value = [(1 + sum(rates[:k])) / (1 + draft_cost * k) for k in range(len(rates) + 1)]
    best = max(range(len(value)), key=value.__getitem__)
    return {
        "k": best,
        "acceptance_by_position": rates,
        "tokens_per_cost": value,
        "try_larger": best == len(rates) > 0 and value[-1] > value[-2],
    }


def suggest_schedule(name: str, arm: ArmTotals, costs_dir: Path | None) -> dict[str, Any] | None:
    """The k schedule `specserve tune` would write for this arm: its measured round costs
    (`<costs_dir>/<arm>.json`) with its live acceptance; None without either."""
    path = costs_dir / f"{name}.json" if costs_dir is not None else None
    chain = live_chain(arm)
    if path is None or not path.exists() or not chain:
        return None
    costs = k_schedule.RoundCosts.load(path)
    schedule = k_schedule.derive(costs, chain[: costs.max_k])
    return {"schedule": [list(r) for r in schedule], "text": k_schedule.describe(schedule)}


def speedup_by_load(
    arm: dict[float, tuple[float, float]],
    base: dict[float, tuple[float, float]],
    load: dict[float, float],
) -> dict[str, float | None]:
    """Mean per-user tokens/s of the arm over the baseline's, in each band of load."""
    sums: dict[str, list[float]] = {label: [0.0, 0.0, 0.0, 0.0] for label, _ in LOAD_BANDS}
    for t, in_flight in load.items():
        label = next(label for label, upper in LOAD_BANDS if in_flight < upper)
        for offset, series in ((0, arm), (2, base)):
            count, total = series.get(t, (0.0, 0.0))
            if count > 0:
                sums[label][offset] += count
                sums[label][offset + 1] += total
    out: dict[str, float | None] = {}
    for label, (n_arm, s_arm, n_base, s_base) in sums.items():
        ok = n_arm > 0 and n_base > 0 and s_base > 0
        out[label] = (s_arm / n_arm) / (s_base / n_base) if ok else None
    return out


def verdict(
    row: dict[str, Any],
    base_n: float,
    base_groups: int | None,
    options: Options,
    base_windows: int | None = None,
) -> tuple[str, str]:
    """Promote or roll back once per-user tokens/s differs with confidence; else keep testing."""
    if row["traffic"]["mismatch"]:
        share = row["traffic"]
        return KEEP_TESTING, (
            f"traffic share {share['observed']:.1%} against weight share "
            f"{share['expected']:.1%}: fallbacks, a drain or sticky keys skew the split"
        )
    n = min(row["requests"], base_n)
    if n < options.min_requests:
        return KEEP_TESTING, f"{n:.0f} requests in the smaller arm, {options.min_requests} needed"
    groups = [g for g in (row["unit_groups"], base_groups) if g is not None]
    if groups and min(groups) < options.min_unit_groups:
        return KEEP_TESTING, (
            f"the smaller arm's requests come from units in {min(groups)} of {UNIT_BUCKETS} "
            f"groups, {options.min_unit_groups} needed: too few users to tell"
        )
    windows = [w for w in (row.get("windows"), base_windows) if w is not None]
    if windows and min(windows) < MIN_WINDOWS:
        return KEEP_TESTING, (
            f"the smaller arm's requests fall in {min(windows)} windows of time, {MIN_WINDOWS} "
            "needed: too short to tell a difference from the node's drift"
        )
    speed = row["tokens_per_s"]["difference"]
    shown = (
        f"tokens/s per user {speed['relative']:+.1%} "
        f"(CI {speed['relative_low']:+.1%} to {speed['relative_high']:+.1%})"
    )
    if speed["low"] > 0:
        losing = {
            key: segment
            for key, segment in row.get("by_key", {}).items()
            if segment["relative"] < -options.max_key_loss
        }
        if losing:
            worst = min(losing, key=lambda key: losing[key]["relative"])
            return KEEP_TESTING, (
                f"faster overall ({shown}), but key {worst}'s requests "
                f"{losing[worst]['relative']:+.1%} (more than the {options.max_key_loss:.0%} "
                f"a key may lose)"
            )
        return PROMOTE, f"faster: {shown}"
    if speed["high"] < 0:
        return ROLL_BACK, f"slower: {shown}"
    return KEEP_TESTING, f"no difference yet: {shown}"


# -- output ---------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report["since"]))
    lines = [
        f"model {report['model']}, config revision {report['revision']}, since {since} "
        f"({(report['now'] - report['since']) / 60:.0f} min); baseline {report['baseline']}; "
        f"always-valid {1 - report['alpha']:.0%} CIs (mixture SPRT)",
        f"unit: {report['unit']}"
        + (
            f" (intervals and split cluster-robust over {UNIT_BUCKETS} groups of units; "
            f"intervals also over windows of {report['window_s']:.0f} s)"
            if report["cluster_robust"]
            else " (each request taken as independent: no unit-group series)"
        ),
        "",
    ]
    header = (
        "arm",
        "requests",
        "traffic/weight",
        "tokens/s",
        "TPOT ms",
        "accept len",
        "k",
        "verdict",
    )
    table = [header]
    for row in report["arms"]:
        share = row["traffic"]
        traffic = f"{share['observed']:.0%}/{share['expected']:.0%}" + (
            " !" if share["mismatch"] else ""
        )
        table.append(
            (
                row["arm"],
                f"{row['requests']:.0f}",
                traffic if not math.isnan(share["observed"]) else "-",
                _cell(row["tokens_per_s"], 1, 1),
                _cell(row["tpot_s"], 1000, 1),
                _cell(row["acceptance_length"], 1, 2),
                str(row["suggested_k"]["k"]) + ("+" if row["suggested_k"]["try_larger"] else "")
                if row["suggested_k"]
                else "-",
                row.get("verdict", "(baseline)"),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.append("")
    for row in report["arms"]:
        if "reason" in row:
            lines.append(f"{row['arm']}: {row['verdict']}: {row['reason']}")
    left_out = [r for r in report["arms"] if r.get("left_out")]
    if left_out:
        counts = ", ".join(f"{r['arm']} {r['left_out']:.0f}" for r in left_out)
        lines.append(
            f"left out, their prompt trained on (routing.ab_left_out_prompts): {counts} requests"
        )
    schedules = [r for r in report["arms"] if r.get("suggested_schedule")]
    if schedules:
        lines += ["", "k by load (from the round costs and the live acceptance per position):"]
        lines += [f"  {r['arm']}: {r['suggested_schedule']['text']}" for r in schedules]
    bands = "  ".join(label for label, _ in LOAD_BANDS)
    lines += ["", f"speedup over {report['baseline']} by requests in flight ({bands}):"]
    for row in report["arms"][1:]:
        cells = "  ".join(
            "-" if v is None else f"{v:.2f}x" for v in row["speedup_by_load"].values()
        )
        lines.append(f"  {row['arm']}: {cells}")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _cell(figure: dict | None, scale: float, digits: int) -> str:
    if figure is None:
        return "-"
    text = f"{figure['mean'] * scale:.{digits}f}"
    if d := figure.get("difference"):
        text += f" ({d['relative_low']:+.0%}..{d['relative_high']:+.0%})"
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus URL")
    parser.add_argument("--baseline", default="no-spec", help="arm to compare against (no-spec)")
    parser.add_argument("--model", help="served model name (default: the only one)")
    parser.add_argument(
        "--since",
        help="experiment start: 30m, 2h, 1d ago, a Unix or ISO time (default: when the active "
        "config revision appeared); keep it fixed between looks",
    )
    parser.add_argument("--alpha", type=float, default=0.05, help="1 - confidence (0.05)")
    parser.add_argument(
        "--tau",
        type=float,
        default=0.1,
        help="mixing scale as a share of the baseline's mean: the relative difference the "
        "intervals are tuned to detect (0.1)",
    )
    parser.add_argument("--min-requests", type=int, default=30)
    parser.add_argument(
        "--max-key-loss",
        type=float,
        default=0.1,
        help="a promotion waits while one key's requests are slower than the baseline's by more "
        "than this share (0.1)",
    )
    parser.add_argument(
        "--min-unit-groups",
        type=int,
        default=8,
        help=f"no verdict while an arm's requests come from units in fewer of the "
        f"{UNIT_BUCKETS} groups the router records (8)",
    )
    parser.add_argument(
        "--draft-cost",
        type=float,
        default=0.1,
        help="cost of drafting and verifying one token, as a share of a target step (0.1)",
    )
    parser.add_argument(
        "--round-costs",
        type=Path,
        metavar="DIR",
        help="round costs per arm (DIR/ARM.json, written by `specserve tune` or "
        "`python -m specserve.bench.round_cost`): also recommend a k schedule per arm",
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.alpha < 1 or args.tau <= 0 or args.draft_cost < 0:
        print("error: need 0 < --alpha < 1, --tau > 0, --draft-cost >= 0", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per query
    options = Options(
        args.baseline,
        args.alpha,
        args.tau,
        args.min_requests,
        args.draft_cost,
        args.max_key_loss,
        args.min_unit_groups,
        args.round_costs,
    )
    prom = Prometheus(args.prometheus)
    try:
        # One start for every look: the intervals are valid over looks at one experiment (by
        # default the active revision's start, which only a new revision moves).
        since = None if args.since is None else parse_since(args.since, time.time())
        while True:
            report = build_report(prom, options, since, args.model)
            if args.watch:
                print("\033[2J\033[H", end="")
            print(render(report), flush=True)
            if args.json:
                args.json.write_text(json.dumps(_finite(report), indent=2))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except (PrometheusError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
