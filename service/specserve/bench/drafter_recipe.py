"""Which training recipe buys the most acceptance per CPU-second? Drafters trained under each
recipe for the same wall-clock budget on the same data and seed, side by side.

A recipe changes one thing from the build's defaults (`TrainConfig`): the TTT depth, the
learning rate, the answer tokens per update or the loss weights of later steps. Each recipe's
seconds per update are measured first (a short probe run), and it then gets as many updates as
fit the budget, with its full warm-up and cosine schedule. Printed: held-out offline acceptance
length (greedy drafting simulated on captured target states) at k = 1 and k = 3, and top-1 per
step, every drafter scored at depth 3 whatever depth it was trained at.

Reads the work directory of `specserve drafter build` after its answer stage (hidden states are
captured here when missing, as the build does).

    python -m specserve.bench.drafter_recipe --variant eagle3.1 --minutes 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

RECIPES: dict[str, dict] = {
    "default": {},
    "depth-1": {"steps": 1},
    "lr-3e-3": {"lr": 3e-3},
    "tokens-256": {"tokens_per_update": 256},
    "step-decay-0.5": {"step_weight_decay": 0.5},
}
EVAL_STEPS = 3
PROBE_UPDATES = 40  # per-update cost varies with sequence length: a short probe misleads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="default: the build's")
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget per recipe")
    parser.add_argument("--variant", choices=["eagle3", "eagle3.1"], default="eagle3.1")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    args = parser.parse_args(argv)

    from specserve.drafter.pipeline import built_records, variant_drafter
    from specserve.drafter.train import TrainConfig, offline_acceptance, train

    work, target, records, validation = built_records(args.work_dir)
    bench_dir = work / "recipe-bench" / f"{args.variant}-{args.minutes:g}min"

    results = []
    for name in args.recipes:
        config = replace(TrainConfig(), **RECIPES[name])
        probe = bench_dir / f"{name}-probe"
        out = bench_dir / name
        for stale in (probe, out):  # a budget's update count depends on the probe: start afresh
            shutil.rmtree(stale, ignore_errors=True)
        model = variant_drafter(target, records, args.variant)
        started = time.monotonic()
        train(model, records, probe, replace(config, updates=PROBE_UPDATES), desc=f"{name} probe")
        per_update = (time.monotonic() - started) / PROBE_UPDATES
        updates = max(PROBE_UPDATES, int(args.minutes * 60 / per_update))
        model = variant_drafter(target, records, args.variant)
        started = time.monotonic()
        model = train(
            model,
            records,
            out,
            replace(config, updates=updates, validate_every=max(1, updates // 4)),
            validation=validation,
            desc=f"{args.variant} {name}",
        )
        minutes = (time.monotonic() - started) / 60
        scored = offline_acceptance(model, validation, EVAL_STEPS)
        results.append(
            {
                "recipe": name,
                "changes": RECIPES[name],
                "seconds_per_update": per_update,
                "updates": updates,
                "minutes": minutes,
                "k1_length": 1 + scored.chain[0],
                "k3_length": scored.mean_acceptance_length,
                "step_top1": scored.step_top1,
            }
        )
        (bench_dir / "results.json").write_text(json.dumps(results, indent=1))

    print(
        f"\n{args.variant}: {len(records)} training and {len(validation)} held-out sequences, "
        f"{args.minutes:g} min of training per recipe; held-out offline acceptance length"
    )
    print("| recipe | s per update | updates | minutes | k = 1 | k = 3 | top-1 per step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        top1 = " / ".join(f"{t:.2f}" for t in r["step_top1"])
        print(
            f"| {r['recipe']} | {r['seconds_per_update']:.2f} | {r['updates']} | "
            f"{r['minutes']:.1f} | {r['k1_length']:.3f} | {r['k3_length']:.3f} | {top1} |"
        )
    print(f"wrote {bench_dir / 'results.json'}")


if __name__ == "__main__":
    main()
