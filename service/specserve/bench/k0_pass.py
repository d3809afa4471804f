"""What the drafter's pass at k = 0 costs an EAGLE arm, and what skipping it costs acceptance.

    python -m specserve.bench.k0_pass --config docs/bench/k0-skip.yaml --arm eagle3.1

One in-process engine of the arm (its engine settings, environment and schedule) serves the
same held-out chat prompts, `--in-flight` at a time, each with its own answer length (48 to 191
tokens, so that requests finish one by one and the engine drafts again once fewer are left than
the schedule's k = 0 range starts at). Passes alternate between vLLM's behaviour (the drafter's
inputs are prepared and it runs over every step's tokens at k = 0) and `skip_drafter_at_k0`
(engine/vllm_fixes.py: neither), in rotating order, so the machine's drift spreads over both.
Per setting: generated tokens/s, the median engine step (prefills included), and the share of
draft tokens accepted in the steps that drafted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from specserve.bench.round_cost import in_process_engine, one_arm_parser, pass_medians

SETTINGS = ("keep", "skip")


def run(arm_name: str, config_path: Path, prompts: int, in_flight: int, passes: int) -> dict:
    model, arm, kwargs = in_process_engine(config_path, arm_name)
    if arm.speculative.method != "eagle3":
        raise SystemExit(f"{arm_name}: not an EAGLE arm of {config_path}")
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specserve.bench.serving import load_prompts
    from specserve.drafter.evaluate import spec_counters
    from specserve.engine import vllm_fixes
    from specserve.models import resolve_model_source

    kwargs.update(max_num_seqs=in_flight, disable_log_stats=False)
    llm = LLM(model=resolve_model_source(model.source), **kwargs)
    runner_propose = GPUModelRunner.propose_draft_token_ids  # the plugin's, where the arm skips
    propose = getattr(runner_propose, "__wrapped__", runner_propose)
    proposers = {"keep": propose, "skip": vllm_fixes.skip_drafter_at_k0(propose)}

    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process
    step_fn, decode_steps = core.step_fn, []

    def timed_step(*args, **kw):
        start = time.perf_counter()
        result = step_fn(*args, **kw)
        decode_steps.append(time.perf_counter() - start)
        return result

    core.step_fn = timed_step
    chats: list[Any] = load_prompts("chat", prompts)
    params = [
        SamplingParams(temperature=0.0, max_tokens=48 + (i * 37) % 144) for i in range(len(chats))
    ]
    llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    found: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for n in range(passes):
        for name in SETTINGS[n % 2 :] + SETTINGS[: n % 2]:
            GPUModelRunner.propose_draft_token_ids = proposers[name]  # type: ignore[method-assign]
            before, decode_steps[:] = spec_counters(llm), []
            start = time.perf_counter()
            outputs = llm.chat(chats, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = spec_counters(llm)
            drafts = after["draft_tokens"] - before["draft_tokens"]
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            found[name].append(
                {
                    "tokens_per_s": tokens / seconds,
                    "step_ms": 1000 * statistics.median(decode_steps),
                    "drafts": drafts,
                    "accepted": (after["accepted"] - before["accepted"]) / max(drafts, 1),
                }
            )
            print(f"pass {n + 1}, {name}: {json.dumps(found[name][-1])}", file=sys.stderr)
    return pass_medians(found)


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings

    parser = one_arm_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args(argv)
    config = args.config or get_settings().config
    result = run(args.arm, config, args.prompts, args.in_flight, args.passes)
    print("| setting | tokens/s | engine step (median) | draft tokens | accepted per draft token |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in result.items():
        print(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} ms | {r['drafts']:.0f} "
            f"| {r['accepted']:.3f} |"
        )
    keep, skip = result["keep"], result["skip"]
    print(f"skip / keep: {skip['tokens_per_s'] / keep['tokens_per_s']:.3f}x tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
