"""How fast the target's hidden states are captured for drafter training: tokens per second.

    python -m specserve.bench.feature_speed --target DIR --device cuda --batch-tokens 1 4096 32768

Runs `drafter.data.features_batched` (the target's forward with every layer's hidden state, the
three captured layers and the final state kept, copied back to the host in bf16) over synthetic
token sequences of `--seq-len` tokens, once per padded-tokens-per-forward budget (1: one
sequence per forward), side by side in one process. Needs torch, transformers and the prepared
target directory only, so it runs on a bare GPU machine. The pass's speed depends on the
target's shape alone: `--random-weights` needs only its config.json (no weights to bring).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.bench.train_speed import device_name


def measure(model, sequences, layers, batch_tokens: int, device: torch.device) -> dict:
    from specserve.drafter.data import features_batched

    features_batched(model, sequences[:2], layers, batch_tokens)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    features_batched(model, sequences, layers, batch_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids, _ in sequences)
    return {"batch_tokens": batch_tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from specserve.drafter.model import DrafterConfig
    from specserve.hardware import fast_dtype

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the prepared target's directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--seq-len", type=int, default=600)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument(
        "--random-weights", action="store_true", help="the target's shape from its config only"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else getattr(torch, fast_dtype())
    config = AutoConfig.from_pretrained(args.target)
    if args.random_weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    layers = DrafterConfig.for_target(config).aux_layer_ids
    g = torch.Generator().manual_seed(0)
    sequences = [
        (torch.randint(0, config.vocab_size, (args.seq_len,), generator=g).tolist(), 300)
        for _ in range(args.sequences)
    ]
    print(f"device: {device_name(device)}; {args.sequences} sequences of {args.seq_len} tokens")
    results = [measure(model, sequences, layers, b, device) for b in args.batch_tokens]
    for r in results:
        print(json.dumps(r))
    base = results[0]["tokens_per_s"]
    print("| padded tokens per forward | tokens/s | vs the first |")
    print("| --- | --- | --- |")
    for r in results:
        print(
            f"| {r['batch_tokens']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
