"""A worker's memory while it computes hidden states for adapt, against the plan's estimate.

    python -m specserve.bench.feature_memory --captured DIR [--replay ANSWERS] [--keep-freed]

Runs, in this process and in a worker's order, the passes an adapt worker runs: the captured
sequences (a capture directory, as served: token ids), then the replayed build answers (an
`answers.jsonl` of conversations). Anonymous memory (what Ray's memory monitor counts) is sampled
every 50 ms; after each pass it prints what the process holds and its peak, and at the end the
forwards' share beside the memory plan's estimate of one forward (drafter/memory.py).
`--keep-freed` leaves the C allocator holding what each forward freed, as adapt did before it
handed that back (`memory.give_back_freed`), for the comparison. No Ray: a Train worker holds
~0.8 GB more for Ray and gloo (memory.PROCESS_BYTES counts them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

GB = 2**30


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig

    from specserve.capture import store
    from specserve.config.schema import load_config
    from specserve.config.settings import DEFAULT_CONFIG_PATH
    from specserve.drafter import data, memory
    from specserve.drafter.data import FEATURE_BATCH_TOKENS, FEATURE_MAX_LEN, SHARD_SEQUENCES
    from specserve.drafter.model import DrafterConfig
    from specserve.hardware import fast_dtype
    from specserve.models import resolve_model_source

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--captured", type=Path, required=True, help="a capture directory")
    parser.add_argument("--replay", type=Path, help="replayed build answers (answers.jsonl)")
    parser.add_argument("--target", help="the target's directory (default: the config's model)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    parser.add_argument("--keep-freed", action="store_true", help="no malloc_trim per forward")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    target = args.target or resolve_model_source(
        load_config(DEFAULT_CONFIG_PATH).config.model.source
    )
    if args.keep_freed:
        data.give_back_freed = lambda: None  # what features_batched calls after each forward
    layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target)).aux_layer_ids
    rows = [
        {"prompt_token_ids": list(r.prompt_token_ids), "output_token_ids": list(r.output_token_ids)}
        for r in store.read(args.captured)
        if r.output_token_ids
    ]
    if not rows:
        parser.error(f"no answered record in {args.captured}")
    lengths = [len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in rows]
    passes: list[dict] = []
    with tempfile.TemporaryDirectory() as work, memory.AnonymousPeak() as used:
        out, start = Path(work), time.monotonic()
        base = memory.anonymous_bytes()

        def done(name: str, count: int) -> None:
            held, peak = memory.anonymous_bytes(), used.peak
            passes.append({"pass": name, "sequences": count, "held": held, "peak": peak})
            print(
                f"{time.monotonic() - start:6.0f} s  {name}: {count} sequences, "
                f"{held / GB:.2f} GB held, peak {peak / GB:.2f} GB",
                flush=True,
            )

        data.capture_token_features(rows, target, out / "captured", layers, threads=args.threads)
        done("captured", len(rows))
        if args.replay:
            answers = out / "answers.jsonl"
            answers.write_text(args.replay.read_text())
            lengths += data.conversation_lengths(answers, target)
            data.capture_features(answers, target, out / "replay", layers, threads=args.threads)
            done("replay", len(lengths) - len(rows))
    shape = memory.TargetShape.of(target, 2 if fast_dtype() == "bfloat16" else 4)
    sequences = memory.Sequences.of(lengths, SHARD_SEQUENCES)
    sizes = memory.Sizes(FEATURE_BATCH_TOKENS["cpu"], FEATURE_MAX_LEN, 0, 0, 0)
    estimate = shape.weight_bytes + memory.forward_bytes(shape, sequences, sizes)
    measured = max(p["peak"] for p in passes) - base
    print(
        f"the target and its forwards: {measured / GB:.2f} GB at the peak, estimated "
        f"{estimate / GB:.2f} GB (longest sequence {sequences.longest} tokens; "
        f"{'freed pages kept' if args.keep_freed else 'freed pages handed back'})"
    )
    if args.json:
        report = {"keep_freed": args.keep_freed, "base": base, "passes": passes}
        report |= {"measured": measured, "estimate": estimate, "longest": sequences.longest}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
