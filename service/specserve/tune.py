"""`specserve tune`: k by load for every drafting arm, from the platform's own measurements,
written as one config revision.

    specserve tune --local --prometheus http://127.0.0.1:9090   # measure, derive, apply
    specserve tune --local --dry-run                            # show the schedules only
    specserve config history --local                            # the tuned revision is there
    specserve config rollback --local                           # and this undoes it

For each arm that drafts (n-gram or EAGLE):
1. its round costs, milliseconds per engine step by batch size and k (`bench.round_cost`: the
   arm's own engine settings in a process of their own), or those of an earlier run (`--costs
   DIR`); on Kubernetes measure them on a node of the arm's kind and pass them with `--costs`;
2. its acceptance per draft position, accepted once drafted, from Prometheus since the active
   config revision (what `ab report` reads; `--since` to choose), else, for an arm without live
   drafts, from the bench prompts of step 1 (the report says which);
3. the schedule that maximises per-user tokens/s at each batch size (k_schedule.derive, from
   the costs fitted to how a round spends its time where there are enough cells), k = 0 where
   drafting loses;
4. all arms' schedules in one new revision of the live config (`num_speculative_tokens_per_
   batch_size` under each arm's `speculative`), which redeploys the arms whose schedule changed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specserve import k_schedule
from specserve.config.changes import arm_changes
from specserve.config.schema import RouterConfig, parse_config
from specserve.config.store import ConfigStore

LIVE, BENCH = "live traffic", "bench prompts"


@dataclass
class ArmTuning:
    arm: str
    costs: k_schedule.RoundCosts
    chain: list[float]
    acceptance_from: str  # LIVE or BENCH
    drafts: float  # live drafts the chain rests on (0 for BENCH)
    before: list[list[int]] | None  # the schedule in force, None for a fixed k
    schedule: list[k_schedule.Range] = field(default_factory=list)
    fitted: k_schedule.CostFit | None = None  # what the schedule came from; None: the cells
    choices: list[k_schedule.Choice] = field(default_factory=list)


def drafting_arms(config: RouterConfig, wanted: list[str] | None) -> list[str]:
    drafting = [a.name for a in config.arms if a.speculative.method != "none"]
    if wanted:
        unknown = sorted(set(wanted) - set(drafting))
        if unknown:
            raise ValueError(
                f"not drafting arms of the live config: {', '.join(unknown)} "
                f"(drafting arms: {', '.join(drafting) or 'none'})"
            )
        return [name for name in drafting if name in wanted]
    return drafting


def round_costs(
    config_text: str,
    arms: list[str],
    *,
    costs_dir: Path | None,
    out: Path,
    batch_sizes: list[int],
    repeats: int,
    log: Callable[[str], None] = print,
) -> dict[str, k_schedule.RoundCosts]:
    """Each arm's costs: `costs_dir/<arm>.json` when there, else measured now (and saved
    under `out`)."""
    from specserve.bench import round_cost

    found: dict[str, k_schedule.RoundCosts] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "live.yaml"
        config_path.write_text(config_text)
        for arm in arms:
            saved = costs_dir / f"{arm}.json" if costs_dir is not None else None
            if saved is not None and saved.exists():
                found[arm] = k_schedule.RoundCosts.load(saved)
                log(f"{arm}: round costs from {saved} ({found[arm].where()})")
                continue
            started = time.monotonic()
            log(f"{arm}: measuring round costs at batch sizes {batch_sizes} ...")
            found[arm] = round_cost.measure(arm, config_path, batch_sizes, repeats=repeats)
            path = found[arm].save(out / f"{arm}.json")
            log(f"{arm}: measured in {time.monotonic() - started:.0f} s -> {path}")
    return found


def live_acceptance(prometheus_url: str | None, since: str | None) -> dict[str, Any]:
    """Per arm, the ArmTotals since the active revision's start (or `since`); {} without a
    Prometheus."""
    if not prometheus_url:
        return {}
    from specserve.ab.prometheus import Prometheus, parse_since

    prom = Prometheus(prometheus_url)
    now = time.time()
    model = prom.model()
    start = parse_since(since, now) if since else prom.revision_start(model, now)[1]
    return prom.totals(model, start, now)


def plan(
    config: RouterConfig,
    costs: dict[str, k_schedule.RoundCosts],
    totals: dict[str, Any],
    min_drafts: int,
) -> list[ArmTuning]:
    from specserve.ab.report import live_chain

    tunings = []
    for name, arm_costs in costs.items():
        arm = config.arm(name)
        assert arm is not None
        spec = arm.speculative
        live = totals.get(name)
        chain = live_chain(live) if live is not None else []
        drafts = live.drafts if live is not None else 0.0
        if chain and drafts >= min_drafts:
            source = LIVE
        else:
            chain, source, drafts = list(arm_costs.bench_chain), BENCH, 0.0
        chain = chain[: arm_costs.max_k]
        before = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        tuning = ArmTuning(
            name, arm_costs, chain, source, drafts, [list(r) for r in before] if before else None
        )
        tuning.choices = k_schedule.choices(arm_costs, chain)
        tuning.schedule, tuning.fitted = k_schedule.derive_with_fit(arm_costs, chain)
        tunings.append(tuning)
    return tunings


def changed_schedules(tunings: list[ArmTuning]) -> dict[str, list[k_schedule.Range]]:
    """The schedules to write: those that differ from what the arm does now. An arm with a
    fixed k whose schedule is that k at every batch size keeps its config as it is (writing it
    would restart its engines for nothing)."""
    found = {}
    for t in tunings:
        fixed = t.before is None and len(t.schedule) == 1 and t.schedule[0][2] == t.costs.max_k
        if not fixed and [list(r) for r in t.schedule] != t.before:
            found[t.arm] = t.schedule
    return found


class _Range(list):
    """A schedule entry, written on one line: `[1, 4, 1]`."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Range, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, True)
)


def tuned_text(live: str, schedules: dict[str, list[k_schedule.Range]]) -> tuple[str, RouterConfig]:
    """The live config with each named arm's schedule set; -> its text and validated config.
    (Written from the parsed document, as the loop writes its revisions: comments go.)"""
    document = yaml.safe_load(live)
    for arm in document["arms"]:
        if arm["name"] in schedules:
            schedule = [_Range(entry) for entry in schedules[arm["name"]]]
            arm["speculative"]["num_speculative_tokens_per_batch_size"] = schedule
    text = yaml.dump(document, Dumper=_Dumper, sort_keys=False)
    return text, parse_config(text.encode(), source="the tuned config")


def render(tunings: list[ArmTuning]) -> str:
    lines = []
    for t in tunings:
        drafts = f", {t.drafts:.0f} drafts" if t.acceptance_from == LIVE else ""
        chain = "/".join(f"{x:.2f}" for x in t.chain)
        lines.append(
            f"{t.arm}: acceptance once drafted by position {chain} (from {t.acceptance_from}"
            f"{drafts}); round costs on {t.costs.where()}"
        )
        ks = range(t.costs.max_k + 1)
        lines.append(
            "  batch size  "
            + "  ".join(f"k={k} tok/s".rjust(11) for k in ks)
            + "  best  gain over k=0"
        )
        for c in t.choices:
            cells = "  ".join(f"{c.tokens_per_s.get(k, float('nan')):11.1f}" for k in ks)
            lines.append(f"  {c.batch_size:>10}  {cells}  {c.k:>4}  {c.gain():.2f}x")
        basis = (
            f"the costs fitted, median error {t.fitted.median_error:.1%}"
            if t.fitted is not None
            else "the measured costs"
        )
        lines.append(
            f"  schedule: {k_schedule.describe(t.schedule)}   (was: "
            f"{k_schedule.describe(t.before, t.costs.max_k)}; from {basis})"
        )
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", nargs="+", help="drafting arms to tune (default: all)")
    parser.add_argument(
        "--prometheus", help="a Prometheus scraping specserve, for live acceptance per position"
    )
    parser.add_argument(
        "--since", help="live acceptance since 30m, 2h, ... ago (default: the active revision)"
    )
    parser.add_argument(
        "--min-drafts",
        type=int,
        default=200,
        help="live drafts an arm needs for its live acceptance to be used, else the bench "
        "prompts' (200)",
    )
    parser.add_argument(
        "--costs", type=Path, metavar="DIR", help="round costs of an earlier run (DIR/ARM.json)"
    )
    parser.add_argument(
        "--out", type=Path, help="where measured round costs go (default: <cache dir>/tune)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3, help="passes over every cell (3)")
    parser.add_argument("--dry-run", action="store_true", help="show the schedules only")


def run(args: argparse.Namespace, store: ConfigStore) -> int:
    """Measure, derive and apply (module docstring) against a config store."""
    from specserve.ab.prometheus import PrometheusError
    from specserve.config.settings import get_settings

    text = store.live_text()
    config = parse_config(text.encode(), source="the live config")
    try:
        arms = drafting_arms(config, args.arms)
        totals = live_acceptance(args.prometheus, args.since)
    except (ValueError, PrometheusError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not arms:
        print("no arm drafts: nothing to tune")
        return 0
    costs = round_costs(
        text,
        arms,
        costs_dir=args.costs,
        out=args.out or get_settings().cache_dir / "tune",
        batch_sizes=args.batch_sizes,
        repeats=args.repeats,
    )
    tunings = plan(config, costs, totals, args.min_drafts)
    print(render(tunings))
    schedules = changed_schedules(tunings)
    if not schedules:
        print("every schedule is already in force: nothing applied")
        return 0
    # The live config again: it may have changed while the costs were measured.
    old_text = store.live_text()
    new_text, new_config = tuned_text(old_text, schedules)
    if args.dry_run:
        print("dry run: nothing applied")
        return 0
    old = parse_config(old_text.encode(), source="the live config")
    changed = [c.name for c in arm_changes(old, new_config) if c.restart]
    if not changed:
        print("every schedule is already in force: nothing applied")
        return 0
    revision = store.apply(new_text, new_config).new_revision
    print(
        f"applied revision {revision}: {', '.join(changed)} redeploy with the new schedule "
        "(`specserve config rollback" + (" --local" if args.local else "") + "` undoes it)"
    )
    return 0
