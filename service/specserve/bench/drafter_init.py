"""Does a drafter learn faster from the target's last decoder layer? Drafters trained from each
initialisation on the same data, seed and number of updates, side by side.

`random`: the build's default. `target-layer`: the decoder layer starts as the target's last
one and `fc` as a pass-through of the last captured state (`train.init_from_target_layer`).
Printed: the held-out offline acceptance length (greedy drafting simulated on captured target
states, `specserve.drafter.train.offline_acceptance`) at every validation, per initialisation.

Reads the work directory of `specserve drafter build` after its answer stage (hidden states are
captured here when missing, as the build does); each training resumes from its checkpoint.

    python -m specserve.bench.drafter_init --variant eagle3.1 --updates 600
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INITS = ("random", "target-layer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="default: the build's")
    parser.add_argument("--updates", type=int, default=600, help="optimizer steps per drafter")
    parser.add_argument("--variant", choices=["eagle3", "eagle3.1"], default="eagle3.1")
    parser.add_argument("--inits", nargs="+", choices=INITS, default=list(INITS))
    parser.add_argument("--validate-every", type=int, default=100)
    args = parser.parse_args(argv)

    from specserve.drafter.pipeline import built_records, variant_drafter
    from specserve.drafter.train import TrainConfig, init_from_target_layer, train

    work, target, records, validation = built_records(args.work_dir)

    curves: dict[str, list[dict]] = {}
    for init in args.inits:
        config = TrainConfig(updates=args.updates, validate_every=args.validate_every)
        model = variant_drafter(target, records, args.variant)
        if init == "target-layer":
            init_from_target_layer(model, target)
        out = work / "init-bench" / f"{args.variant}-{args.updates}-{init}"
        train(model, records, out, config, validation=validation, desc=f"{args.variant} {init}")
        curves[init] = json.loads((out / "validation.json").read_text())

    print(
        f"\n{args.variant}: {len(records)} training and {len(validation)} held-out sequences, "
        f"{args.updates} updates; held-out offline acceptance length (top-1 per step)"
    )
    print("| update | " + " | ".join(args.inits) + " |")
    print("| --- |" + " --- |" * len(args.inits))
    updates = sorted({point["update"] for curve in curves.values() for point in curve})
    for update in updates:
        cells = []
        for init in args.inits:
            point = next((p for p in curves[init] if p["update"] == update), None)
            top1 = " / ".join(f"{t:.2f}" for t in point["step_top1"]) if point else ""
            length = 1 + sum(point["chain"]) if point else float("nan")
            cells.append(f"{length:.3f} ({top1})")
        print(f"| {update} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
