"""A worker's memory while it computes hidden states for adapt, against the plan's estimate.

    python -m specserve.bench.feature_memory --captured DIR [--replay ANSWERS] [--keep-freed]
    python -m specserve.bench.feature_memory --synthetic 229,30 --train 10 --threads 1

Runs, in this process and in a worker's order, the passes an adapt worker runs: the captured
sequences (a capture directory, as served: token ids), then the replayed build answers (an
`answers.jsonl` of conversations); or, with `--synthetic C,R`, C random sequences of a captured
ticket's length (200-280 tokens) and R of a replayed answer's (300-2,690). `--train N` then
trains the shipped EAGLE-3.1 N updates on those states, as the worker does next. Anonymous memory
(what Ray's memory monitor counts) is sampled every 50 ms; after each pass it prints what the
process holds and its peak, and at the end the forwards' and training's shares beside the memory
plan's estimates (drafter/memory.py).
`--keep-freed` leaves the C allocator holding what each forward freed, as adapt did before it
handed that back (`memory.give_back_freed`), for the comparison. No Ray: a Train worker holds
~0.8 GB more for Ray and gloo (memory.PROCESS_BYTES counts them).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
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
    from specserve.models import resolve_model_source

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--captured", type=Path, help="a capture directory")
    source.add_argument("--synthetic", help="C,R: random captured-like and replay-like sequences")
    parser.add_argument("--train", type=int, default=0, help="then train this many updates")
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
    replayed: list[dict] = []
    if args.synthetic:
        captured_count, replay_count = (int(n) for n in args.synthetic.split(","))
        rows, replayed = (
            synthetic_rows(captured_count, 200, 280),
            synthetic_rows(replay_count, 300, 2690),
        )
    else:
        rows = [
            {
                "prompt_token_ids": list(r.prompt_token_ids),
                "output_token_ids": list(r.output_token_ids),
            }
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

        def done(name: str, count: int, unit: str = "sequences") -> None:
            held, peak = memory.anonymous_bytes(), used.peak
            passes.append({"pass": name, "sequences": count, "held": held, "peak": peak})
            print(
                f"{time.monotonic() - start:6.0f} s  {name}: {count} {unit}, "
                f"{held / GB:.2f} GB held, peak {peak / GB:.2f} GB",
                flush=True,
            )

        shards = data.capture_token_features(
            rows, target, out / "captured", layers, threads=args.threads
        )
        done("captured", len(rows))
        if replayed:
            lengths += [len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in replayed]
            shards += data.capture_token_features(
                replayed, target, out / "replay", layers, threads=args.threads
            )
            done("replay", len(replayed))
        if args.replay:
            answers = out / "answers.jsonl"
            answers.write_text(args.replay.read_text())
            lengths += data.conversation_lengths(answers, target)
            shards += data.capture_features(
                answers, target, out / "replay", layers, threads=args.threads
            )
            done("replay", len(lengths) - len(rows))
        training = None
        if args.train:
            before_training = memory.anonymous_bytes()
            with memory.AnonymousPeak() as in_training:
                train_drafter(target, shards, out / "trained", args.train)
            done("training", args.train, "updates")
            training = {"held_before": before_training, "peak": in_training.peak}
            training["added"] = in_training.peak - before_training
    shape = memory.TargetShape.of(target)
    sequences = memory.Sequences.of(lengths, SHARD_SEQUENCES)
    sizes = memory.Sizes(FEATURE_BATCH_TOKENS["cpu"], FEATURE_MAX_LEN, 0, 0, 0)
    estimate = shape.weight_bytes + memory.forward_bytes(shape, sequences, sizes)
    measured = max(p["peak"] for p in passes if p["pass"] != "training") - base
    print(
        f"the target and its forwards: {measured / GB:.2f} GB at the peak, estimated "
        f"{estimate / GB:.2f} GB (longest sequence {sequences.longest} tokens; "
        f"{'freed pages kept' if args.keep_freed else 'freed pages handed back'})"
    )
    report = {"keep_freed": args.keep_freed, "base": base, "passes": passes}
    report |= {"measured": measured, "estimate": estimate, "longest": sequences.longest}
    if training is not None:
        from specserve.drafter.adapt import adapt_training, planned_sizes

        planned = planned_sizes(adapt_training(), base_drafter())
        training["estimate"] = memory.training_bytes(shape, sequences, planned)
        report["training"] = training
        print(
            f"training: {training['held_before'] / GB:.2f} GB held before it, peak "
            f"{training['peak'] / GB:.2f} GB, adding {training['added'] / GB:.2f} GB, estimated "
            f"{training['estimate'] / GB:.2f} GB"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def base_drafter() -> str:
    from specserve.models import resolve_drafter_source

    return resolve_drafter_source("package://eagle3.1")


def synthetic_rows(count: int, shortest: int, longest: int) -> list[dict]:
    """Random token ids of uniformly spread lengths, the last 80-192 of each the answer."""
    rng = random.Random(count * 7919 + longest)
    rows = []
    for _ in range(count):
        length = rng.randrange(shortest, longest + 1)
        answer = min(length - 8, rng.randrange(80, 193))
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        rows.append({"prompt_token_ids": ids[:-answer], "output_token_ids": ids[-answer:]})
    return rows


def train_drafter(target: str, shards: list[Path], out: Path, updates: int) -> None:
    """adapt's training stage on the computed states: the shipped EAGLE-3.1 on the target's
    embedding, the records memory-mapped (train.load_records), adapt's training settings."""
    from specserve.drafter.adapt import adapt_training
    from specserve.drafter.model import Drafter
    from specserve.drafter.train import load_records, target_weights, train

    model = Drafter.from_pretrained(base_drafter(), target_weights(target)["embed"])
    config = replace(
        adapt_training(), updates=updates, validate_every=1 << 30, checkpoint_every=1 << 30
    )
    train(model, load_records(shards), out, config, desc="training")


if __name__ == "__main__":
    raise SystemExit(main())
