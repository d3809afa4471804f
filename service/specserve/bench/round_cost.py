"""What one engine step costs an arm, by batch size and k: the cost half of a k schedule.

    python -m specserve.bench.round_cost --arms eagle3.1 --batch-sizes 1 4 16 32 --out tune/

For each drafting arm of a config (default: the configured one), a child process starts the
arm's own engine, with the arm's engine settings and environment (its cores, dtype, batch
limit), as an in-process vLLM engine with dynamic speculative decoding on. For each batch size
b and each k from 0 to the arm's `num_speculative_tokens`, it sets every batch size's k to k in
the scheduler's lookup, keeps exactly b held-out chat prompts in flight (greedy, a fixed number
of tokens each) and times every engine step (schedule, forward, drafting, verification, output)
that ran b requests and no prefill. A cell's cost is the median of those steps over
`--repeats` passes that take the (b, k) cells in turns, so a slow moment of the machine
spreads over every cell instead of falling on one. It also records the acceptance at each
draft position at the largest k (accepted once drafted), a fallback for an arm that has served
no live traffic yet.

Run it where the arm runs (the same kind of machine, its cores idle): `specserve tune` runs it
and combines the costs with live acceptance from Prometheus (k_schedule.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from specserve.config.schema import ArmEngineConfig, ModelConfig
from specserve.hardware import CPU_BIND_ENV
from specserve.k_schedule import RoundCosts

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
TOKENS_PER_REQUEST = 48  # enough decode steps per pass to outweigh the one prefill step


def in_process_engine(
    config_path: Path, arm_name: str
) -> tuple[ModelConfig, ArmEngineConfig, dict]:
    """An arm of a config file set up to run as an in-process vLLM engine here, as its replicas
    run it: its environment set in this process (before vLLM loads specserve's plugin) and the
    engine core kept in this process, to time and switch. -> (model, arm, engine arguments)."""
    from specserve.config.schema import load_config
    from specserve.engine.arm import engine_env, engine_kwargs

    config = load_config(config_path).config
    arm = config.arm(arm_name)
    if arm is None:
        raise SystemExit(f"{arm_name}: no such arm in {config_path}")
    os.environ.update(engine_env(arm))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    bind_to_cores(os.environ.get(CPU_BIND_ENV, ""))
    return config.model, arm, engine_kwargs(arm, config.model)


def bind_to_cores(cores: str) -> None:
    """Run this process's OpenMP threads on `cores` (a `VLLM_CPU_OMP_THREADS_BIND` list, "0-1,3"),
    as vLLM's multiprocess executor binds a served engine's worker. An in-process engine is not
    bound by vLLM: left alone, torch would run the arm's matrix products on every core of the
    machine, and its costs would be those of an engine twice the size on 2 cores. "", "auto"
    and "nobind" leave the process as it is."""
    if cores in ("", "auto", "nobind"):
        return
    if "|" in cores:
        raise ValueError(f"{CPU_BIND_ENV}={cores!r} binds several ranks; one process measures one")
    from vllm.utils.cpu_resource_utils import parse_id_list  # as vLLM reads the variable

    ids = parse_id_list(cores)
    os.environ["OMP_NUM_THREADS"] = str(len(ids))
    for thread in os.listdir("/proc/self/task"):  # threads started so far keep their own mask
        with contextlib.suppress(ProcessLookupError):  # ended since listed
            os.sched_setaffinity(int(thread), ids)
    if "torch" in sys.modules:  # its OpenMP runtime has read OMP_NUM_THREADS already
        sys.modules["torch"].set_num_threads(len(ids))


def one_arm_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a bench that runs one arm's in-process engine (`in_process_engine`) with
    `--in-flight` requests at once, its settings alternating over `--passes` each."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=None, help="default: the configured one")
    parser.add_argument("--arm", default="eagle3.1")
    parser.add_argument("--in-flight", type=int, default=16, help="requests at once")
    parser.add_argument("--passes", type=int, default=4, help="per setting")
    return parser


def pass_medians(found: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per setting, the median over its passes of each figure a pass recorded."""
    return {
        name: {key: statistics.median(p[key] for p in runs) for key in runs[0]}
        for name, runs in found.items()
    }


def worker(arm_name: str, config_path: Path, sizes: list[int], repeats: int, tokens: int) -> dict:
    """In this process: load the arm's engine, measure every (b, k) cell, print the result."""
    model, arm, kwargs = in_process_engine(config_path, arm_name)
    assert arm.speculative.method != "none"
    from vllm import LLM, SamplingParams

    from specserve.bench.serving import load_prompts
    from specserve.models import resolve_model_source

    max_k = arm.speculative.num_speculative_tokens  # type: ignore[union-attr]
    batch_limit = arm.ongoing_per_replica()
    sizes = [b for b in sizes if b <= batch_limit]
    # Dynamic speculative decoding on, so that the scheduler asks each step's k of its lookup.
    kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = [
        [1, batch_limit, max_k]
    ]
    kwargs.update(disable_log_stats=False, max_num_seqs=batch_limit)
    kwargs.pop("per_request_spec_decode_metrics", None)
    llm = LLM(model=resolve_model_source(model.source), **kwargs)
    cores = computing_cores()
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process
    scheduler = core.scheduler
    steps: dict[tuple[int, int], list[float]] = defaultdict(list)
    last: dict = {}
    schedule, step_fn = scheduler.schedule, core.step_fn

    def scheduled(*args, **kw):
        last["output"] = out = schedule(*args, **kw)
        return out

    def timed_step(*args, **kw):
        start = time.perf_counter()
        result = step_fn(*args, **kw)
        out = last.pop("output", None)
        if out is not None and not out.scheduled_new_reqs:
            requests = len(out.num_scheduled_tokens)
            # Decode only: no request is prefilling (at most its drafts and one token each).
            if out.total_num_scheduled_tokens <= requests * (1 + max_k):
                steps[(requests, out.num_spec_tokens_to_schedule)].append(
                    time.perf_counter() - start
                )
        return result

    scheduler.schedule, core.step_fn = scheduled, timed_step
    prompts = load_prompts("chat", max(sizes))
    chats: list[Any] = [prompts[i % len(prompts)] for i in range(max(sizes))]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)

    def run(b: int, k: int) -> None:
        scheduler.dynamic_sd_lookup = [k] * (batch_limit + 1)
        llm.chat(chats[:b], params, use_tqdm=False)

    run(min(sizes), max_k)  # warm-up
    steps.clear()
    cells = [(b, k) for b in sizes for k in range(max_k + 1)]
    for repeat in range(repeats):
        turn = cells[repeat % len(cells) :] + cells[: repeat % len(cells)]
        for b, k in turn:
            run(b, k)
        print(f"pass {repeat + 1} of {repeats} done", file=sys.stderr, flush=True)
    acceptance = _acceptance_at(llm, run, max(sizes), max_k)
    return {
        "arm": arm_name,
        "max_k": max_k,
        "ms": {
            b: {k: 1000 * statistics.median(steps[(b, k)]) for k in range(max_k + 1)}
            for b in sizes
            if all(steps[(b, k)] for k in range(max_k + 1))
        },
        "steps_timed": {f"{b}/{k}": len(v) for (b, k), v in sorted(steps.items())},
        "bench_chain": acceptance,
        "cores": cores,
    }


def computing_cores() -> list[int]:
    """The cores this process's engine computes on: its threads' mask, one OpenMP thread each."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if torch.get_num_threads() != len(cores):
        raise RuntimeError(
            f"the engine runs {torch.get_num_threads()} threads on cores {cores}: not bound "
            f"as a served engine is ({CPU_BIND_ENV}={os.environ.get(CPU_BIND_ENV)!r})"
        )
    return cores


def _acceptance_at(llm, run, batch: int, max_k: int) -> list[float]:
    """Accepted-once-drafted rate per position on the bench prompts at k = max_k."""
    from specserve.drafter.evaluate import spec_counters

    before = spec_counters(llm)
    run(batch, max_k)
    after = spec_counters(llm)
    drafts = after["drafts"] - before["drafts"]
    earlier = list(before["per_position"]) + [0] * len(after["per_position"])
    per_position = [a - b for a, b in zip(after["per_position"], earlier, strict=False)]
    return [round(x / drafts, 4) if drafts else 0.0 for x in per_position][:max_k]


def measure(
    arm: str,
    config_path: Path,
    sizes: list[int],
    *,
    repeats: int = 3,
    tokens: int = TOKENS_PER_REQUEST,
) -> RoundCosts:
    """Run the worker for one arm in a child process; -> its costs (and bench acceptance)."""
    command = [sys.executable, "-m", "specserve.bench.round_cost", "--worker", arm]
    command += ["--config", str(config_path), "--repeats", str(repeats), "--tokens", str(tokens)]
    command += ["--batch-sizes", *map(str, sizes)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {arm}'s round costs failed (exit code {done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    costs = RoundCosts.from_json(
        {
            "arm": arm,
            "max_k": result["max_k"],
            "ms": result["ms"],
            "machine": machine(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "bench_chain": result["bench_chain"],
            "cores": result["cores"],
        }
    )
    return costs


def machine() -> str:
    """Where the costs were measured: CPU model and cores (costs do not travel between kinds)."""
    import platform

    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model or platform.machine()}, {os.cpu_count()} CPUs"


def markdown(costs: RoundCosts) -> str:
    ks = range(costs.max_k + 1)
    lines = [
        f"{costs.arm}: ms per engine step ({costs.machine})",
        "| batch size | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "| --- |" + " --- |" * len(ks),
    ]
    for b in costs.batch_sizes():
        lines.append(f"| {b} | " + " | ".join(f"{costs.ms[b][k]:.1f}" for k in ks) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=None, help="default: the configured one")
    parser.add_argument("--arms", nargs="*", help="drafting arms to measure (default: all)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="passes over every (b, k) cell")
    parser.add_argument("--tokens", type=int, default=TOKENS_PER_REQUEST, help="per request")
    parser.add_argument("--out", type=Path, default=Path("round-costs"))
    parser.add_argument("--worker", metavar="ARM", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config_path = args.config or get_settings().config
    if args.worker:
        result = worker(args.worker, config_path, args.batch_sizes, args.repeats, args.tokens)
        print(json.dumps(result))
        return 0
    from specserve.config.schema import load_config

    config = load_config(config_path).config
    arms = args.arms or [a.name for a in config.arms if a.speculative.method != "none"]
    for name in arms:
        print(f"{name}: measuring round costs ...", flush=True)
        costs = measure(name, config_path, args.batch_sizes, repeats=args.repeats)
        costs.save(args.out / f"{name}.json")
        print(markdown(costs))
        print(f"acceptance once drafted on the bench prompts: {costs.bench_chain}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
