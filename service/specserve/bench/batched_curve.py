"""Does batching change what the trainer learns? The validation curve of one drafter trained
with its sequences one per forward and batched, on the same data in the same order.

    python -m specserve.bench.batched_curve --updates 300 --validate-every 50 \\
        --out docs/bench/batched-curve

Trains an EAGLE-3.1 drafter twice from the same start (a `drafter build` work directory's
answers and cached features, its draft vocabulary, the default recipe, one seed): with
`batch_tokens: 0` (one sequence per forward) and with the device's default (several sequences
per forward). Every
update holds the same sequences in both runs, so the curves differ only by the arithmetic's
rounding (bf16 autocast). Writes `<out>.json` (both curves, each run's seconds) and `<out>.png`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specserve.drafter.train import TrainConfig, batch_tokens_for, train


def curve(history_file: Path) -> list[tuple[int, float]]:
    return [(h["update"], 1 + sum(h["chain"])) for h in json.loads(history_file.read_text())]


def main(argv: list[str] | None = None) -> int:
    from specserve.drafter.pipeline import built_records, variant_drafter

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="default: the build's")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--validate-every", type=int, default=50)
    parser.add_argument("--validation", type=int, default=64, help="validation sequences")
    parser.add_argument("--out", type=Path, required=True, help="<out>.json and <out>.png")
    args = parser.parse_args(argv)

    _, target, training, validation = built_records(args.work_dir)
    validation = validation[: args.validation]
    device = torch.device("cpu")
    base = TrainConfig(
        updates=args.updates, validate_every=args.validate_every, checkpoint_every=1 << 30
    )
    runs: dict[str, dict[str, Any]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="batched-curve-"))  # checkpoints: not for docs/
    for name, batch_tokens in (("one sequence", 0), ("batched", batch_tokens_for(None, device))):
        out = scratch / str(batch_tokens)
        model = variant_drafter(target, training, "eagle3.1")
        started = time.monotonic()
        config = replace(base, batch_tokens=batch_tokens)
        train(model, training, out, config, validation=validation, desc=name)
        runs[name] = {
            "batch_tokens": batch_tokens,
            "seconds": round(time.monotonic() - started, 1),
            "curve": curve(out / "validation.json"),
        }
    result = {
        "training_sequences": len(training),
        "validation_sequences": len(validation),
        "tokens_per_update": base.tokens_per_update,
        "runs": runs,
    }
    shutil.rmtree(scratch)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(runs, args.out.with_suffix(".png"), base.tokens_per_update)
    print("| update | " + " | ".join(runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for i, (update, _) in enumerate(next(iter(runs.values()))["curve"]):
        lengths = " | ".join(f"{r['curve'][i][1]:.3f}" for r in runs.values())
        print(f"| {update} | {lengths} |")
    print(", ".join(f"{name}: {r['seconds']} s" for name, r in runs.items()))
    return 0


def plot(runs: dict, path: Path, tokens_per_update: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        updates, lengths = zip(*run["curve"], strict=True)
        ax.plot(updates, lengths, marker="o", label=f"{name} ({run['seconds']:.0f} s)")
    ax.set_xlabel(f"update ({tokens_per_update} answer tokens each)")
    ax.set_ylabel("validation acceptance length (k = 3, offline)")
    ax.set_title("EAGLE-3.1, the same sequences per update")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
