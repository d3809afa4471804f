"""Is the drafter data-bound? Drafters trained for the same number of updates on nested shares
of the same training data, side by side.

For each share: validation offline acceptance (held-out sequences, greedy drafting simulated on
captured target states, `specserve.drafter.train.offline_acceptance`) and the same on training
sequences it saw. If more data at equal compute raises held-out acceptance, and training
sequences score well above held-out ones, the drafter is limited by data, not by training time.

Reads the work directory of `specserve drafter build` after its answer stage (hidden states
are captured here when missing, as the build does); each training resumes from its checkpoint.

    python -m specserve.bench.drafter_data --shares 1 0.25 --updates 1200   # ~50 min here
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

FIT_SAMPLE = 100  # training sequences scored for the train / held-out gap


def nested_order(records: list[dict]) -> list[dict]:
    """Records in a content-hash order: every share is a prefix, so smaller shares nest."""
    return sorted(records, key=lambda r: hashlib.sha1(r["input_ids"].numpy().tobytes()).digest())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="default: the build's")
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.25, 0.5])
    parser.add_argument("--updates", type=int, default=600, help="optimizer steps per share")
    parser.add_argument("--variant", choices=["eagle3", "eagle3.1"], default="eagle3")
    args = parser.parse_args(argv)

    from specserve.drafter.pipeline import built_records, variant_drafter
    from specserve.drafter.train import TrainConfig, offline_acceptance, train

    work, target, records, validation = built_records(args.work_dir)
    records = nested_order(records)

    rows = []
    for share in args.shares:  # in the order given: the most telling first
        subset = records[: max(1, round(share * len(records)))]
        answer_tokens = sum(r["input_ids"].numel() - r["answer_start"] for r in subset)
        epochs = args.updates * TrainConfig.tokens_per_update / answer_tokens
        config = TrainConfig(updates=args.updates)
        model = variant_drafter(target, subset, args.variant)  # as the build's drafters
        out = work / "data-bench" / f"{args.variant}-{args.updates}-{share:g}"
        train(model, subset, out, config, desc=f"{args.variant} on {share:g} of the data")
        held_out = offline_acceptance(model, validation, config.steps)
        seen = offline_acceptance(model, subset[:FIT_SAMPLE], config.steps)
        rows.append(
            {
                "share": share,
                "sequences": len(subset),
                "answer_tokens": answer_tokens,
                "epochs": epochs,
                "held_out": held_out.mean_acceptance_length,
                "held_out_top1": held_out.step_top1,
                "seen": seen.mean_acceptance_length,
            }
        )
        results = work / "data-bench" / f"{args.variant}-{args.updates}.json"
        results.write_text(json.dumps(rows, indent=1))

    print(f"\n{args.variant}, {args.updates} updates each, {len(validation)} held-out sequences")
    print(
        "| share | sequences | answer tokens | epochs | held-out acc. length "
        "| held-out top-1 per step | acc. length on training sequences |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: r["share"]):
        top1 = " / ".join(f"{a:.2f}" for a in r["held_out_top1"])
        print(
            f"| {r['share']:g} | {r['sequences']} | {r['answer_tokens']:,} | {r['epochs']:.2f} "
            f"| {r['held_out']:.3f} | {top1} | {r['seen']:.3f} |"
        )


if __name__ == "__main__":
    main()
