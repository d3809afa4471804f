"""What a speculative engine costs at a step where it drafts nothing, against an engine without
speculation: both arms' engines in one process, in turns.

    python -m specserve.bench.k0_overhead --config docs/bench/every-load-one-core.yaml \
        --arm eagle3.1 --baseline no-spec

At 16 requests and more the EAGLE arms' schedules draft nothing (k = 0), so there an EAGLE arm
can at best tie with `no-spec`, and whatever being a speculative engine costs per step shows as
a loss. Between two served engines the model's forward pass varies by several per cent from
process to process, which hides a difference of one per cent. Here both engines run in this
process on the arm's cores: the arm with its schedule set to k = 0 at every batch size (it
drafts nothing; its environment, so specserve's fixes, as configured), the baseline as
configured. Both answer the same held-out chat prompts, `--in-flight` at once, each exactly
`--tokens` tokens long. Passes alternate which engine runs first. A pass's second run is
slower by a few tenths of a millisecond per step (the machine warms), so the difference of each
part is the mean of the paired differences, half of them measured each way round.

Per engine: generated tokens/s and the milliseconds per engine step of each timed part (the
engine core's step, the scheduler's, and the model runner's parts, outermost first; medians
over the passes), then the order-balanced difference, arm minus baseline, and for how many
prompts the two engines gave the same greedy answer.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from specserve.bench.round_cost import in_process_engine, one_arm_parser, pass_medians
from specserve.bench.step_parts import timed

# Timed parts: (where, method). The model runner's are named as in bench/step_parts.py.
PARTS = (
    ("EngineCore", "step"),
    ("Scheduler", "schedule"),
    ("GPUModelRunner", "execute_model"),
    ("GPUModelRunner", "_prepare_inputs"),
    ("GPUModelRunner", "_model_forward"),
    ("GPUModelRunner", "sample_tokens"),
    ("GPUModelRunner", "_sample"),
    ("GPUModelRunner", "_bookkeeping_sync"),
    ("Scheduler", "update_from_output"),
)


def never_drafting(spec: dict[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """The arm's vLLM speculative config with its schedule set to k = 0 at every batch size."""
    return {**spec, "num_speculative_tokens_per_batch_size": [[1, max_num_seqs, 0]]}


def balanced_differences(
    arm_runs: list[dict[str, float]], base_runs: list[dict[str, float]]
) -> dict[str, float]:
    """Per figure, the mean over passes of arm minus baseline. Passes alternate which engine
    runs first, so with an even number of passes a pass's second-run drift cancels out."""
    if len(arm_runs) != len(base_runs) or not arm_runs:
        raise ValueError("one run of each engine per pass")
    return {
        key: statistics.fmean(a[key] - b[key] for a, b in zip(arm_runs, base_runs, strict=True))
        for key in arm_runs[0]
    }


def _instrument(spent: dict[str, float], calls: dict[str, int]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    owners = {"EngineCore": EngineCore, "Scheduler": Scheduler, "GPUModelRunner": GPUModelRunner}
    for owner, name in PARTS:
        current = getattr(owners[owner], name)
        setattr(owners[owner], name, functools.wraps(current)(timed(current, name, spent, calls)))


def run(
    arm_name: str, baseline: str, config_path: Path, in_flight: int, tokens: int, passes: int
) -> dict[str, Any]:
    # The baseline first: the arm's environment and cores are the ones left in force.
    base_model, _, base_kwargs = in_process_engine(config_path, baseline)
    model, arm, kwargs = in_process_engine(config_path, arm_name)
    if arm.speculative.method == "none" or "speculative_config" in base_kwargs:
        raise SystemExit(f"{arm_name} must speculate and {baseline} must not")
    if base_model.source != model.source:
        raise SystemExit("both arms must serve one model")
    from vllm import LLM, SamplingParams

    from specserve.bench.serving import load_prompts
    from specserve.models import resolve_model_source

    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    _instrument(spent, calls)
    kwargs["speculative_config"] = never_drafting(kwargs["speculative_config"], in_flight)
    engines = {}
    for name, engine_args in ((baseline, base_kwargs), (arm_name, kwargs)):
        engine_args = dict(engine_args, max_num_seqs=in_flight)
        engine_args.pop("per_request_spec_decode_metrics", None)
        engines[name] = LLM(model=resolve_model_source(model.source), **engine_args)
    chats: list[Any] = load_prompts("chat", in_flight)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    for llm in engines.values():
        llm.chat(chats, params, use_tqdm=False)  # warm-up
    names = list(engines)
    found: dict[str, list[dict]] = {name: [] for name in names}
    answers: dict[str, list[list[int]]] = {}  # each engine's first pass, greedy
    for n in range(passes):
        for name in names[n % 2 :] + names[: n % 2]:
            spent.clear()
            calls.clear()
            start = time.perf_counter()
            outputs = engines[name].chat(chats, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            steps = max(1, calls["step"])
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            answers.setdefault(name, [list(o.outputs[0].token_ids) for o in outputs])
            found[name].append(
                {"tokens_per_s": generated / seconds}
                | {part: 1000 * spent[part] / steps for _, part in PARTS}
            )
            print(f"pass {n + 1}, {name}: {json.dumps(found[name][-1])}", file=sys.stderr)
    same = sum(a == b for a, b in zip(answers[arm_name], answers[baseline], strict=True))
    return {
        "same_answers": [same, len(chats)],
        "medians": pass_medians(found),
        "difference": balanced_differences(found[arm_name], found[baseline]),
        "passes": found,
    }


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings

    parser = one_arm_parser(__doc__)
    parser.add_argument("--baseline", default="no-spec", help="an arm without speculation")
    parser.add_argument("--tokens", type=int, default=128, help="generated per request")
    parser.add_argument("--out", type=Path, default=None, help="also write every pass as JSON")
    args = parser.parse_args(argv)
    if args.passes % 2:
        parser.error("--passes must be even, for each engine to run first as often")
    config = args.config or get_settings().config
    result = run(args.arm, args.baseline, config, args.in_flight, args.tokens, args.passes)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    medians, difference = result["medians"], result["difference"]
    parts = [part for _, part in PARTS]
    print(f"| engine | tokens/s | {' | '.join(parts)} |")
    print("| --- " * (len(parts) + 2) + "|")
    for name, r in medians.items():
        cells = " | ".join(f"{r[part]:.3f} ms" for part in parts)
        print(f"| {name} | {r['tokens_per_s']:.1f} | {cells} |")
    cells = " | ".join(f"{difference[part]:+.3f} ms" for part in parts)
    print(f"| difference (order-balanced) | {difference['tokens_per_s']:+.1f} | {cells} |")
    base = medians[args.baseline]
    print(
        f"{args.arm} at k = 0 / {args.baseline}: "
        f"{1 + difference['tokens_per_s'] / base['tokens_per_s']:.4f}x tokens/s, "
        f"{difference['step']:+.3f} ms per step ({difference['step'] / base['step']:+.2%}); "
        "the same greedy answer for {} of {} prompts".format(*result["same_answers"])
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
