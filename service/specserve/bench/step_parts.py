"""Where a speculative engine's step goes, with vLLM's sampling, drafting and draft-argmax steps
and with specserve's (engine/vllm_fixes.py: `plain_sample_without_drafts`, `skip_drafter_at_k0`
where the arm skips; the arm's `speculative.use_local_argmax_reduction`).

    python -m specserve.bench.step_parts --config docs/bench/k0-cost.yaml --arm eagle3.1-k0
    python -m specserve.bench.step_parts --config docs/bench/every-load-lookup.yaml \
        --arm eagle3.1 --in-flight 4             # k = 3 by the arm's schedule: the drafter's pass

One in-process engine of the arm (its engine settings, environment and schedule) answers the same
held-out chat prompts, `--in-flight` at once, each exactly `--tokens` tokens long. Passes
alternate between the two settings in rotating order, so the machine's drift spreads over both.
Per setting: generated tokens/s and the milliseconds per engine step of each part of the model
runner's step (medians over the passes; `execute_model` holds the input preparation and the
forward pass, `sample_tokens` the sampling and the drafting). The model's forward pass varies
by several per cent from pass to pass on a shared machine, so the parts say more than tokens/s.
An arm without speculation runs the same passes as the reference (nothing it runs is switched).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from specserve.bench.round_cost import in_process_engine, one_arm_parser, pass_medians

SETTINGS = ("vllm", "specserve")
# The model runner's parts that are timed, outermost first; the switched ones are the fixes'.
PARTS = (
    "execute_model",
    "_prepare_inputs",
    "_model_forward",
    "sample_tokens",
    "_sample",
    "propose_draft_token_ids",
)
SWITCHED = ("_sample", "propose_draft_token_ids")


def timed(method, name: str, spent: dict[str, float], calls: dict[str, int]):
    """`method` (of a class, like `current`) adding its seconds to `spent[name]` and its calls to
    `calls[name]`."""

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            calls[name] += 1

    return wrapper


def _instrument(
    runner_cls, setting: dict[str, str], spent: dict[str, float], calls: dict[str, int]
) -> None:
    """Time and count each part on the class; a switched part calls vLLM's own function or the
    plugin's wrapper of it, by `setting["now"]`."""
    for name in PARTS:
        current = getattr(runner_cls, name)
        if name in SWITCHED:
            chosen = {"vllm": getattr(current, "__wrapped__", current), "specserve": current}
        else:
            chosen = {s: current for s in SETTINGS}

        def by_setting(self, *args, _chosen=chosen, **kwargs):
            return _chosen[setting["now"]](self, *args, **kwargs)

        setattr(runner_cls, name, functools.wraps(current)(timed(by_setting, name, spent, calls)))


def run(arm_name: str, config_path: Path, in_flight: int, tokens: int, passes: int) -> dict:
    model, arm, kwargs = in_process_engine(config_path, arm_name)
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specserve.bench.serving import load_prompts
    from specserve.models import resolve_model_source

    kwargs.pop("per_request_spec_decode_metrics", None)
    kwargs.update(max_num_seqs=in_flight)
    llm = LLM(model=resolve_model_source(model.source), **kwargs)  # loads specserve's plugin
    # The drafter's argmax over its own vocabulary (specserve's default) or over its logits
    # scattered into the target's (vLLM's), where the arm asks for the former.
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process
    drafter = getattr(core.model_executor.driver_worker.worker.model_runner, "drafter", None)
    local_argmax = bool(getattr(drafter, "use_local_argmax_reduction", False))
    setting = {"now": SETTINGS[0]}
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    _instrument(GPUModelRunner, setting, spent, calls)
    chats: list[Any] = load_prompts("chat", in_flight)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    llm.chat(chats, params, use_tqdm=False)  # warm-up
    found: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for n in range(passes):
        for name in SETTINGS[n % 2 :] + SETTINGS[: n % 2]:
            setting["now"] = name
            if local_argmax:
                drafter.use_local_argmax_reduction = name == "specserve"  # type: ignore[union-attr]
            spent.clear()
            calls.clear()
            start = time.perf_counter()
            outputs = llm.chat(chats, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            steps = max(1, calls["execute_model"])
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            found[name].append(
                {"tokens_per_s": generated / seconds}
                | {part: 1000 * spent[part] / steps for part in PARTS}
            )
            print(f"pass {n + 1}, {name}: {json.dumps(found[name][-1])}", file=sys.stderr)
    return pass_medians(found)


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings

    parser = one_arm_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=128, help="generated per request")
    args = parser.parse_args(argv)
    config = args.config or get_settings().config
    result = run(args.arm, config, args.in_flight, args.tokens, args.passes)
    print("| setting | tokens/s | " + " | ".join(PARTS) + " |")
    print("| --- " * (len(PARTS) + 2) + "|")
    for name, r in result.items():
        cells = " | ".join(f"{r[part]:.2f} ms" for part in PARTS)
        print(f"| {name} | {r['tokens_per_s']:.1f} | {cells} |")
    vllm, ours = result["vllm"], result["specserve"]
    print(f"specserve / vllm: {ours['tokens_per_s'] / vllm['tokens_per_s']:.3f}x tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
