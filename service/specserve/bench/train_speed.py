"""How fast the drafter trainer runs on a device: updates/s and answer tokens/s.

    python -m specserve.bench.train_speed --device cuda --steps 3 7 --tokens-per-update 4096 16384

Trains an EAGLE-3.1 drafter of the embedded target's shape (hidden 576, three captured layers,
8,192-token draft vocabulary) on synthetic captured sequences (`--seq-len` tokens, the last
`--answer-len` of them the answer) with `drafter.train.train`, once per (TTT steps, tokens per
update, sequences per forward) combination, side by side in one process. `--batch-tokens 0` is
the one-sequence-per-forward trainer; the default compares it with the batched one. Needs no
target model, no data and no vLLM: only torch, so it runs on a bare GPU machine. Each
combination first trains `--warmup` updates (not timed) on its own model, then `--updates`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from specserve.drafter import model as drafter_model
from specserve.drafter.model import Drafter, DrafterConfig
from specserve.drafter.train import TrainConfig, batch_tokens_for, train


def synthetic_records(
    count: int,
    seq_len: int,
    answer_len: int,
    config: DrafterConfig,
    seed: int = 0,
    spread: float = 0.0,
) -> list[dict]:
    """Sequences shaped like captured ones: token ids, three captured layers at the scales the
    embedded target's have (about 1, 4 and 8 RMS), the answer at the end. With `spread`, prompt
    lengths vary uniformly by that fraction either way (as real ones do: every batch a new
    shape); the answer keeps its length."""
    g = torch.Generator().manual_seed(seed)
    layers = len(config.aux_layer_ids)
    scales = torch.tensor([1.0, 4.0, 8.0][:layers]).repeat_interleave(config.hidden_size)
    prompt = seq_len - answer_len
    records = []
    for _ in range(count):
        vary = int(round(prompt * spread * (2 * float(torch.rand((), generator=g)) - 1)))
        length = answer_len + max(1, prompt + vary)
        ids = torch.randint(0, config.vocab_size, (length,), generator=g)
        aux = torch.randn(length, layers * config.hidden_size, generator=g) * scales
        records.append(
            {
                "input_ids": ids.to(torch.int32),
                "aux": aux.to(torch.bfloat16),
                "answer_start": length - answer_len,
            }
        )
    return records


def new_model(device: torch.device, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(fc_norm=True, norm_output=True)
    model = Drafter(config)
    model.set_draft_vocab(torch.randperm(config.vocab_size)[: config.draft_vocab_size])
    return model.to(device)


def measure(
    records: list[dict],
    device: torch.device,
    *,
    steps: int,
    tokens_per_update: int,
    batch_tokens: int,
    updates: int,
    warmup: int,
) -> dict:
    model = new_model(device)
    base = dict(steps=steps, tokens_per_update=tokens_per_update, batch_tokens=batch_tokens)
    base.update(checkpoint_every=1 << 30, validate_every=1 << 30, seed=0)
    with tempfile.TemporaryDirectory() as work:
        if warmup:
            config = TrainConfig(updates=warmup, **base)  # type: ignore[arg-type]
            train(model, records, Path(work) / "warmup", config, desc="warm-up")
        config = TrainConfig(updates=updates, **base)  # type: ignore[arg-type]
        _sync(device)
        start = time.perf_counter()
        train(model, records, Path(work) / "timed", config, desc=f"k{steps} b{batch_tokens}")
        _sync(device)
        seconds = time.perf_counter() - start
    answer_per_record = records[0]["input_ids"].numel() - records[0]["answer_start"]
    # An update takes whole sequences until it holds `tokens_per_update` answer tokens.
    per_update = -(-tokens_per_update // answer_per_record) * answer_per_record
    result = {
        "device": str(device),
        "steps": steps,
        "tokens_per_update": tokens_per_update,
        "batch_tokens": batch_tokens,
        "updates": updates,
        "seconds": seconds,
        "updates_per_s": updates / seconds,
        "answer_tokens_per_s": updates * per_update / seconds,
    }
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, nargs="+", default=[3], help="TTT depths")
    parser.add_argument("--tokens-per-update", type=int, nargs="+", default=[512])
    parser.add_argument(
        "--batch-tokens",
        type=int,
        nargs="+",
        help="padded tokens per forward (0: one sequence per forward); default: 0 and the "
        "trainer's default on the device",
    )
    parser.add_argument("--seq-len", type=int, default=600)
    parser.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="prompt lengths vary by this fraction either way (0: every sequence --seq-len)",
    )
    parser.add_argument("--answer-len", type=int, default=300)
    parser.add_argument("--sequences", type=int, default=256, help="synthetic sequences")
    parser.add_argument("--updates", type=int, default=20, help="timed updates per combination")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let attention use cuDNN's kernels too (PyTorch's default on Hopper; the trainer "
        "leaves them out: they build a graph per input shape)",
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.cudnn_attention:
        drafter_model.CUDA_ATTENTION = [SDPBackend.CUDNN_ATTENTION, *drafter_model.CUDA_ATTENTION]
    if not 0 < args.answer_len < args.seq_len:
        parser.error("--answer-len must be positive and below --seq-len")

    device = torch.device(args.device)
    args.batch_tokens = args.batch_tokens or [0, batch_tokens_for(None, device)]
    config = DrafterConfig()
    records = synthetic_records(
        args.sequences, args.seq_len, args.answer_len, config, spread=args.spread
    )
    spread = f" (prompts +-{args.spread:.0%})" if args.spread else ""
    print(
        f"device: {device_name(device)}; {args.sequences} sequences of {args.seq_len} tokens"
        f"{spread}"
    )
    results = []
    for steps in args.steps:
        for tokens in args.tokens_per_update:
            for batch_tokens in args.batch_tokens:
                result = measure(
                    records,
                    device,
                    steps=steps,
                    tokens_per_update=tokens,
                    batch_tokens=batch_tokens,
                    updates=args.updates,
                    warmup=args.warmup,
                )
                results.append(result)
                print(json.dumps(result), flush=True)
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(device), "results": results}))
    return 0


def markdown(results: list[dict]) -> str:
    lines = [
        "| TTT steps | answer tokens per update | padded tokens per forward | updates/s "
        "| answer tokens/s | vs one sequence per forward |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        base = next(
            (
                b
                for b in results
                if b["batch_tokens"] == 0
                and (b["steps"], b["tokens_per_update"]) == (r["steps"], r["tokens_per_update"])
            ),
            None,
        )
        ratio = f"{r['answer_tokens_per_s'] / base['answer_tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['steps']} | {r['tokens_per_update']} | {r['batch_tokens'] or 'one sequence'} "
            f"| {r['updates_per_s']:.2f} | {r['answer_tokens_per_s']:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
