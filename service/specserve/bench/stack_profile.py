"""Where the platform's own time goes: CPU per streamed token of every process on the path, and
a py-spy profile of each, put in parts, for specserve and vLLM's own server side by side.

    python -m specserve.bench.stack_profile [--streams 30] [--out DIR]

Starts both servers as `stack_overhead` does (one-arm config; specserve's engine on core 0,
vLLM's on core 1), then for each server in turn sends 1-token completions, then 96-token
streams, one at a time, while
py-spy samples every process on its path (200 Hz, active samples only: CPU time) and psutil
reads each process's CPU time. Processes: specserve's HTTP proxy (uvicorn, the dispatch, Ray
Serve's routing), the arm's replica (its OpenAI front and vLLM's AsyncLLM), the engine core,
and the rest of Ray (GCS, raylet, controller, agents); vLLM's API server and engine core.
CPU ms per request (or streamed token) = the process's CPU time over the phase / requests (or
tokens streamed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from specserve.bench.spec_round import py_spy
from specserve.bench.stack_overhead import (
    VLLM,
    Server,
    machine,
    plain,
    start_specserve,
    start_vllm,
    stream,
    write_config,
)
from specserve.config.serve_config import ARM_APP_PREFIX, ROUTER_APP_NAME, ROUTER_DEPLOYMENT_NAME
from specserve.config.settings import DEFAULT_CONFIG_PATH

# A process's role on the path, by its command line (first match). vLLM's CPU engine runs in two
# processes: the engine core (scheduling, output) and its worker (the forward passes).
ROLES = (
    ("HTTP proxy", "ProxyActor"),
    ("arm replica", f"ServeReplica:{ARM_APP_PREFIX}"),
    ("engine worker", "VLLM::Worker"),
    ("engine core", "EngineCore"),
    ("router app", f"ServeReplica:{ROUTER_APP_NAME}:{ROUTER_DEPLOYMENT_NAME}"),
    ("Serve controller", "ServeController"),
)
PROFILED = ("HTTP proxy", "arm replica", "API server")
OTHER_RAY = "other Ray processes"
REQUESTS, STREAMS = "1-token requests", "96-token streams"
UNITS = {REQUESTS: "request", STREAMS: "token"}
VLLM_API = "API server"

# A sample's part, by the frames on its stack (outermost first; the first marker found wins,
# searched from the innermost frame out).
PARTS = (
    ("JSON / pickling", ("json/", "dumps", "loads", "pickle", "model_dump", "_serialize")),
    ("HTTP (uvicorn, h11/httptools)", ("uvicorn/", "h11/", "httptools")),
    ("specserve dispatch and arm calls", ("specserve/router/", "specserve/wire/arm_calls")),
    ("specserve front", ("specserve/engine/front",)),
    (
        "Ray Serve proxy / router",
        ("serve/_private/proxy", "serve/_private/router", "request_router", "serve/handle"),
    ),
    ("Ray Serve replica", ("serve/_private/replica", "serve/_private/http_util")),
    ("Ray core (actor calls, streaming)", ("ray/_raylet", "_private/worker", "ray/_private/")),
    ("starlette / FastAPI", ("starlette/", "fastapi/")),
    (
        "vLLM output processing",
        (
            "vllm/v1/engine/output_processor",
            "vllm/v1/engine/async_llm",
            "detokenizer",
            "tokenizers",
        ),
    ),
    ("vLLM serving (OpenAI layer)", ("vllm/entrypoints/",)),
    ("engine step", ("vllm/v1/engine/core.py", "vllm/v1/worker", "vllm/model_executor", "torch/")),
    ("asyncio event loop", ("asyncio/", "uvloop")),
)
OTHER_PART = "other"
# py-spy sees Python frames only: a sample whose innermost frame is a thread's entry (or no
# frame at all) is in native code — an event loop run by its own thread (uvloop's C loop),
# a thread pool's C work, Ray's core worker.
NATIVE_PARTS = (
    ("event loop thread (native)", "Thread.run ("),
    ("thread pool (native)", "_WorkItem.run ("),
    ("thread pool (native)", "_worker (concurrent/futures/thread.py"),
)
NATIVE_NO_FRAMES = "native, no Python frame (Ray core worker)"


def part_of(stack: list[str]) -> str:
    frames = [f for f in stack if f]
    if not frames:
        return NATIVE_NO_FRAMES
    for part, marker in NATIVE_PARTS:
        if frames[-1].startswith(marker):
            return part
    for frame in reversed(frames):
        for part, markers in PARTS:
            if any(marker in frame for marker in markers):
                return part
    return OTHER_PART


def read_parts(path: Path) -> Counter:
    """py-spy's raw output (`frame;frame;... count` per line) as samples per part."""
    parts: Counter = Counter()
    if not path.exists():
        return parts
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if count.isdigit():
            parts[part_of(stack_text.split(";"))] += int(count)
    return parts


def path_processes(server: Server) -> dict[str, list[psutil.Process]]:
    """The processes on `server`'s path, by role."""
    top = psutil.Process(server.process.pid)
    found: dict[str, list[psutil.Process]] = {}
    for process in [top, *top.children(recursive=True)]:
        try:
            cmdline = " ".join(process.cmdline())
        except psutil.Error:
            continue
        role = next((r for r, marker in ROLES if marker in cmdline), None) or other_role(cmdline)
        if process.pid == top.pid:
            role = VLLM_API if server.name == VLLM else "specserve serve (driver)"
        found.setdefault(role, []).append(process)
    return found


def other_role(cmdline: str) -> str:
    """`Ray: NAME` for the rest of Ray's processes: the actor's or daemon's name, or the script a
    Python process runs (log monitor, dashboard, ...)."""
    words = cmdline.split()
    if not words:
        return OTHER_RAY
    if words[0].startswith("ray::"):
        return f"Ray: {words[0].removeprefix('ray::')}"
    program = Path(words[0]).name
    if program.startswith("python"):
        program = Path(next((w for w in words[1:] if w.endswith(".py")), program)).name
    return f"Ray: {program}"


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


async def one_at_a_time(server: Server, model: str, phase: str, n: int) -> int:
    """Requests of `phase` one after the other; the units done (tokens streamed, requests)."""
    done = 0
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(n):
            if phase == STREAMS:
                done += (await stream(client, server, model)).tokens
            else:
                await plain(client, server, model)
                done += 1
    return done


def profile(server: Server, model: str, phase: str, n: int, out: Path) -> dict[str, Any]:
    asyncio.run(one_at_a_time(server, model, phase, 5))  # warm-up
    roles = path_processes(server)
    spies = {}
    for role, processes in roles.items():
        if role in PROFILED:
            raw = out / f"{server.name}-{phase}-{role.replace(' ', '-')}.txt"
            spies[role] = (
                raw,
                subprocess.Popen(
                    [
                        py_spy(),
                        "record",
                        "--pid",
                        str(processes[0].pid),
                        "--rate",
                        "200",
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        str(raw),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
    time.sleep(2.0)  # py-spy attaches
    before = {role: cpu_seconds(p) for role, p in roles.items()}
    start = time.perf_counter()
    units = asyncio.run(one_at_a_time(server, model, phase, n))
    wall = time.perf_counter() - start
    after = {role: cpu_seconds(p) for role, p in roles.items()}
    for _, spy in spies.values():
        spy.send_signal(signal.SIGINT)
    for _, spy in spies.values():
        spy.wait(60)
    ms = 1000.0
    return {
        "server": server.name,
        "phase": phase,
        "units": units,
        "wall_ms_per_unit": wall * ms / units,
        "cpu_ms_per_unit": {r: (after[r] - before[r]) * ms / units for r in roles},
        "parts": {role: dict(read_parts(raw)) for role, (raw, _) in spies.items()},
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        unit = UNITS[r["phase"]]
        lines.append(
            f"\n**{r['server']}, {r['phase']}**: {r['units']} {unit}s, "
            f"{r['wall_ms_per_unit']:.2f} ms per {unit} (wall)\n"
        )
        lines.append(f"| process | CPU ms per {unit} | parts (share of its py-spy samples) |")
        lines.append("| --- | --- | --- |")
        for role, cpu in sorted(r["cpu_ms_per_unit"].items(), key=lambda kv: -kv[1]):
            parts = r["parts"].get(role, {})
            total = sum(parts.values())
            text = ", ".join(
                f"{part} {count / total:.0%}"
                for part, count in sorted(parts.items(), key=lambda kv: -kv[1])
                if count / total >= 0.02
            )
            lines.append(f"| {role} | {cpu:.2f} | {text} |")
    return "\n".join(lines)


# The processes in front of the engine, stacked in the plot; the rest of Ray's in one.
FRONT_ROLES = ("HTTP proxy", "arm replica", VLLM_API, "Serve controller")
ENGINE_ROLES = ("engine core", "engine worker")


def _cpu_of(result: dict[str, Any], role: str) -> float:
    cpu = result["cpu_ms_per_unit"]
    if role != OTHER_RAY:
        return float(cpu.get(role, 0.0))
    known = {*FRONT_ROLES, *ENGINE_ROLES}
    return float(sum(v for r, v in cpu.items() if r not in known))


def plot(results: list[dict[str, Any]], out: Path) -> Path:
    """CPU ms per request and per streamed token of the processes in front of the engine, a
    stacked bar per server and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, phase in zip(axes, (REQUESTS, STREAMS), strict=True):
        rows = [r for r in results if r["phase"] == phase]
        names = [r["server"] for r in rows]
        left = [0.0] * len(rows)
        for role in (*FRONT_ROLES, OTHER_RAY):
            widths = [_cpu_of(r, role) for r in rows]
            ax.barh(names, widths, left=left, label=role)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.invert_yaxis()
        ax.set_xlabel(f"CPU ms per {UNITS[phase]}, outside the engine")
        ax.set_title(phase, fontsize=9)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=30, help="96-token streams per server")
    parser.add_argument("--requests", type=int, default=300, help="1-token requests per server")
    parser.add_argument("--port", type=int, default=8300, help="specserve's (and +1, +2)")
    parser.add_argument("--out", type=Path, help="keep the raw profiles and results here")
    args = parser.parse_args(argv)

    from specserve.config.schema import load_config
    from specserve.models import prepare_model, resolve_model_source

    model = load_config(DEFAULT_CONFIG_PATH).config.model
    prepare_model(model.source)
    with tempfile.TemporaryDirectory(prefix="stack-profile-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        config = out / "one-arm.yaml"
        write_config("one-arm", 0, config)
        results = []
        reference = start_vllm(
            model.name, resolve_model_source(model.source), 1, args.port + 2, out
        )
        try:
            ours = start_specserve(config, args.port, out)
            try:
                for phase, n in ((REQUESTS, args.requests), (STREAMS, args.streams)):
                    for server in (ours, reference):
                        results.append(profile(server, model.name, phase, n, out))
            finally:
                ours.stop()
        finally:
            reference.stop()
        print(f"machine: {machine()}")
        print(markdown(results))
        (out / "stack-profile.json").write_text(json.dumps(results, indent=1))
        print(f"plot: {plot(results, out / 'stack-profile.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
