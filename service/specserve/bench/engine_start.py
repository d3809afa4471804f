"""How long an engine takes to start, side by side, with and without the two cuts specserve makes.

Offline engines (the drafter toolkit's generation and scoring stages): vLLM's engine in the
stage's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, drafter/data.py) against vLLM's
default of two processes of its own (engine core, then worker). Each start in a fresh child
process, alternating; the embedded target with the shipped EAGLE-3 drafter, as adapt scores.

Serving engines (an arm's Ray Serve LLM replica, engine/node_init.py): with and without Ray
Serve LLM's per-node step, on a local Ray cluster of this machine, alternating: the time from
`serve.run` to the application RUNNING.

    python -m specserve.bench.engine_start --rounds 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

OFFLINE_MODES = {"in this process": "0", "two processes of its own": "1"}
SERVING_MODES = ("node step skipped", "node step run")


def offline_start(multiprocessing_flag: str, queue) -> None:
    """One offline engine's start in this (fresh) process: seconds, and the memory of this
    process and its children once it is up."""
    from specserve.drafter.data import GENERATION_ENV, shutdown
    from specserve.models import PACKAGED_DRAFTERS_DIR, resolve_model_source

    os.environ.update(GENERATION_ENV, VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing_flag)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=resolve_model_source("embedded://SmolLM2-135M-Instruct"),
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=32,
        speculative_config={
            "method": "eagle3",
            "model": str(PACKAGED_DRAFTERS_DIR / "eagle3"),
            "num_speculative_tokens": 3,
        },
    )
    start_s = time.perf_counter() - started
    me = psutil.Process()
    rss = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=8), use_tqdm=False)
    shutdown(llm)
    queue.put({"start_s": start_s, "rss_gb": rss / 1e9})


def offline(rounds: int) -> dict[str, list[dict]]:
    context = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict]] = {mode: [] for mode in OFFLINE_MODES}
    for round_ in range(rounds):
        for mode, flag in OFFLINE_MODES.items():
            queue = context.Queue()
            child = context.Process(target=offline_start, args=(flag, queue))
            child.start()
            runs[mode].append(queue.get(timeout=600))
            child.join()
            print(f"offline round {round_ + 1}, {mode}: {runs[mode][-1]}", flush=True)
    return runs


def serving(rounds: int) -> dict[str, list[float]]:
    """An arm's replica started and deleted `rounds` times per mode on a local Ray cluster."""
    import ray
    from ray import serve
    from ray.llm._internal.common.callbacks.base import CallbackConfig
    from ray.serve.llm import build_llm_deployment

    from specserve.config.schema import parse_config
    from specserve.engine.arm import build_llm_config

    config = parse_config(
        "model: {name: m, source: 'embedded://SmolLM2-135M-Instruct', accelerator: cpu}\n"
        "arms:\n  - {name: no-spec, weight: 1, engine: {enforce_eager: true},"
        " env: {VLLM_CPU_KVCACHE_SPACE: '1', VLLM_CPU_OMP_THREADS_BIND: '0-1',"
        " VLLM_CPU_NUM_OF_RESERVED_CPU: '0'}}\n"
    )
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False)
    with socket.socket() as free:  # Serve's HTTP proxy on any free port
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    arm = config.arm("no-spec")
    assert arm is not None
    runs: dict[str, list[float]] = {mode: [] for mode in SERVING_MODES}
    try:
        for round_ in range(rounds):
            for mode in SERVING_MODES:
                llm_config = build_llm_config(arm, config.model)
                if mode == "node step run":
                    llm_config.callback_config = CallbackConfig()  # Ray Serve LLM's default
                app = build_llm_deployment(llm_config, override_serve_options={"name": "arm"})
                started = time.perf_counter()
                serve.run(app, name="engine-start", route_prefix="/engine-start")
                runs[mode].append(time.perf_counter() - started)
                serve.delete("engine-start")
                print(f"serving round {round_ + 1}, {mode}: {runs[mode][-1]:.1f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs


def markdown(offline_runs: dict[str, list[dict]], serving_runs: dict[str, list[float]]) -> str:
    lines = ["| engine | how | start, s (median) | runs, s | memory when up, GB |"]
    lines.append("|---|---|---:|---|---:|")
    for mode, runs in offline_runs.items():
        starts = [r["start_s"] for r in runs]
        rss = statistics.median(r["rss_gb"] for r in runs)
        each = ", ".join(f"{s:.1f}" for s in starts)
        lines.append(f"| offline | {mode} | {statistics.median(starts):.1f} | {each} | {rss:.2f} |")
    for mode, starts in serving_runs.items():
        each = ", ".join(f"{s:.1f}" for s in starts)
        lines.append(f"| serving | {mode} | {statistics.median(starts):.1f} | {each} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="starts per mode (alternating)")
    parser.add_argument("--skip-serving", action="store_true", help="offline engines only")
    parser.add_argument("--json", type=Path, help="also write the runs here")
    args = parser.parse_args(argv)
    offline_runs = offline(args.rounds)
    serving_runs = {} if args.skip_serving else serving(args.rounds)
    print(markdown(offline_runs, serving_runs))
    if args.json:
        result: dict[str, Any] = {"offline": offline_runs, "serving": serving_runs}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
