"""The platform's own cost: specserve against vLLM's own OpenAI server on the same engine.

    python -m specserve.bench.stack_overhead [--configs one-arm default] [--pairs 200]

What a user compares specserve with is what they would run instead: vLLM's
`vllm.entrypoints.openai.api_server`. For each core placement (specserve's engine on core 0 and
vLLM's server's on core 1, then swapped) and each specserve config, this starts `specserve
serve` and vLLM's server side by side, with the same engine settings (the config's `no-spec`
arm: bf16 where the CPU has it, eager, 32 sequences, 1 GiB of KV cache, its engine's threads
bound to one core), and sends the same requests to both, alternated so that both see the same
machine state:
- 1-token completions, in pairs (which goes first alternates);
- 96-token streams one at a time, in pairs: time to first token and time between tokens;
- 96-token streams four at a time (concurrency 4), one server after the other in each round.
Configs: `one-arm` (only `no-spec`, weight 100) and `default` (the embedded default, with
requests forced onto `no-spec`; its other engines sit idle). Reports percentiles per server,
paired differences and per-user output tokens/s, and names the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from specserve import headers
from specserve.bench.router_overhead import percentile
from specserve.config.settings import DEFAULT_CONFIG_PATH
from specserve.hardware import CPU_BIND_ENV, cpu_flags, fast_dtype

ARM = "no-spec"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
STREAM_TOKENS = 96
STREAM_PROMPT = "Write a long story about a lighthouse keeper and a storm."
START_TIMEOUT_S = 900.0
SPECSERVE, VLLM = "specserve", "vllm"


def machine() -> str:
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    isa = "AVX-512 bf16" if "avx512_bf16" in cpu_flags() else "AVX2 only"
    if "amx_bf16" in cpu_flags():
        isa += " + AMX"
    return f"{os.cpu_count()} vCPU {name} ({isa})"


def write_config(kind: str, core: int, path: Path) -> None:
    """The specserve config: `no-spec` on `core`; for `one-arm` the only arm."""
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    if kind == "one-arm":
        config["arms"] = [{**a, "weight": 100} for a in config["arms"] if a["name"] == ARM]
    for arm in config["arms"]:
        if arm["name"] == ARM:
            arm["env"][CPU_BIND_ENV] = str(core)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen
    request_headers: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,  # its own group, to stop it whole; the same session (scheduling group)
        )


def wait_ready(server: Server, path: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited while starting; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + path, timeout=5).status_code == 200:
                return
        time.sleep(2)
    server.stop()
    raise SystemExit(f"{server.name} not ready after {START_TIMEOUT_S:g} s; see {log}")


def start_specserve(
    config: Path, port: int, workdir: Path, extra_env: dict[str, str] | None = None
) -> Server:
    log = workdir / f"specserve-{config.stem}.log"
    env = {
        **(extra_env or {}),
        "SPECSERVE_CONFIG": str(config),
        "SPECSERVE_PORT": str(port),
        "SPECSERVE_METRICS_PORT": str(port + 1),
    }
    process = _start([sys.executable, "-m", "specserve.cli", "serve"], env, log)
    server = Server(SPECSERVE, f"http://127.0.0.1:{port}", process, {headers.ARM_OVERRIDE: ARM})
    wait_ready(server, "/ready", log)
    return server


def start_vllm(model: str, model_path: str, core: int, port: int, workdir: Path) -> Server:
    """vLLM's own server with the `no-spec` arm's engine settings."""
    log = workdir / f"vllm-core{core}.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        model,
        "--dtype",
        fast_dtype(),
        "--enforce-eager",
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    process = _start(command, {**ENGINE_ENV, CPU_BIND_ENV: str(core)}, log)
    server = Server(VLLM, f"http://127.0.0.1:{port}", process)
    wait_ready(server, "/health", log)
    return server


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Stream:
    ttft_s: float
    gaps_s: list[float]  # between consecutive content chunks
    tokens: int
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


async def plain(client: httpx.AsyncClient, server: Server, model: str) -> float:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    answer = await client.post(
        f"{server.url}/v1/completions", json=body, headers=server.request_headers
    )
    answer.raise_for_status()
    return time.perf_counter() - start


async def stream(client: httpx.AsyncClient, server: Server, model: str) -> Stream:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": STREAM_PROMPT}],
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=server.request_headers
    ) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{server.name}: a stream without content")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return Stream(arrivals[0] - start, gaps, len(arrivals), arrivals[-1] - start)


def alternated(n: int) -> Iterator[tuple[int, bool]]:
    """Pair indices, and whether specserve goes first in that pair."""
    for i in range(n):
        yield i, i % 2 == 0


async def measure(
    servers: dict[str, Server], model: str, args: argparse.Namespace, label: str
) -> dict[str, Any]:
    ms = 1000.0
    a, b = servers[SPECSERVE], servers[VLLM]
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for i in range(10):  # warm-up: connections, caches, first-call paths
            for server in (a, b):
                await plain(client, server, model)
                if i < 2:
                    await stream(client, server, model)

        times: dict[str, list[float]] = {SPECSERVE: [], VLLM: []}
        for _, a_first in tqdm(list(alternated(args.pairs)), desc=f"{label} 1-token", leave=False):
            for server in (a, b) if a_first else (b, a):
                times[server.name].append(await plain(client, server, model) * ms)
        diffs = [x - y for x, y in zip(times[SPECSERVE], times[VLLM], strict=True)]
        out["plain"] = {**_summary(times), "paired_median": statistics.median(diffs)}

        streams: dict[str, list[Stream]] = {SPECSERVE: [], VLLM: []}
        for _, a_first in tqdm(
            list(alternated(args.streams)), desc=f"{label} streams", leave=False
        ):
            for server in (a, b) if a_first else (b, a):
                streams[server.name].append(await stream(client, server, model))
        out["stream_c1"] = _stream_summary(streams)

        streams = {SPECSERVE: [], VLLM: []}
        for _, a_first in tqdm(
            list(alternated(args.rounds_c4)), desc=f"{label} 4 streams", leave=False
        ):
            for server in (a, b) if a_first else (b, a):
                batch = await asyncio.gather(*(stream(client, server, model) for _ in range(4)))
                streams[server.name].extend(batch)
        out["stream_c4"] = _stream_summary(streams)
    return out


def _summary(times: dict[str, list[float]]) -> dict[str, Any]:
    return {name: {f"p{q}": percentile(v, q) for q in (50, 90, 99)} for name, v in times.items()}


def _stream_summary(streams: dict[str, list[Stream]]) -> dict[str, Any]:
    ms = 1000.0
    ttft = {n: [s.ttft_s * ms for s in v] for n, v in streams.items()}
    gaps = {n: [g * ms for s in v for g in s.gaps_s] for n, v in streams.items()}
    tps = {n: [s.tokens_per_s for s in v] for n, v in streams.items()}
    paired_ttft = [x - y for x, y in zip(ttft[SPECSERVE], ttft[VLLM], strict=True)]
    return {
        "ttft": {**_summary(ttft), "paired_median": statistics.median(paired_ttft)},
        "between_tokens": {
            **_summary(gaps),
            "p50_ratio": percentile(gaps[SPECSERVE], 50) / percentile(gaps[VLLM], 50),
            "mean_ratio": statistics.fmean(gaps[SPECSERVE]) / statistics.fmean(gaps[VLLM]),
        },
        "tokens_per_s": {n: statistics.fmean(v) for n, v in tps.items()},
        "tokens": {n: sum(s.tokens for s in v) for n, v in streams.items()},
    }


# -- report -----------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]]) -> str:
    rows = [
        "| config | variant | cores (specserve / vLLM) | 1-token p50 | paired median "
        "| TTFT p50 (c=1) | paired median | between tokens p50 (c=1) | ratio "
        "| between tokens p50 (c=4) | ratio "
        "| tokens/s per user c=1 | c=4 |",
        "|" + " --- |" * 13,
    ]
    for r in results:
        p, s1, s4 = r["plain"], r["stream_c1"], r["stream_c4"]

        def pair(block: dict, key: str = "p50") -> str:
            return f"{block[SPECSERVE][key]:.1f} / {block[VLLM][key]:.1f} ms"

        def tps(block: dict) -> str:
            t = block["tokens_per_s"]
            return f"{t[SPECSERVE]:.1f} / {t[VLLM]:.1f}"

        rows.append(
            f"| {r['config']} | {r['variant']} | {r['cores']} | {pair(p)} "
            f"| {p['paired_median']:+.1f} ms "
            f"| {pair(s1['ttft'])} | {s1['ttft']['paired_median']:+.1f} ms "
            f"| {pair(s1['between_tokens'])} | {s1['between_tokens']['p50_ratio']:.3f} "
            f"| {pair(s4['between_tokens'])} | {s4['between_tokens']['p50_ratio']:.3f} "
            f"| {tps(s1)} | {tps(s4)} |"
        )
    return "\n".join(rows)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    return name, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs", nargs="+", default=["one-arm", "default"], choices=["one-arm", "default"]
    )
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["0:1", "1:0"],
        help="specserve's engine core : vLLM's server's engine core",
    )
    parser.add_argument("--pairs", type=int, default=200, help="1-token request pairs")
    parser.add_argument("--streams", type=int, default=20, help="stream pairs, one at a time")
    parser.add_argument("--rounds-c4", type=int, default=6, help="rounds of 4 streams each")
    parser.add_argument("--port", type=int, default=8300, help="specserve's (and +1, +2)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also measure specserve with these environment variables (Ray Serve's flags), "
        "against the same vLLM server; repeatable",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from specserve.config.schema import load_config
    from specserve.models import prepare_model, resolve_model_source

    variants = [("as shipped", {}), *(parse_variant(v) for v in args.variant)]
    model_config = load_config(DEFAULT_CONFIG_PATH).config.model
    prepare_model(model_config.source)
    model_path = resolve_model_source(model_config.source)
    results = []
    with tempfile.TemporaryDirectory(prefix="stack-overhead-") as tmp:
        workdir = Path(tmp)
        for placement in args.placements:
            ours, theirs = (int(c) for c in placement.split(":"))
            reference = start_vllm(model_config.name, model_path, theirs, args.port + 2, workdir)
            try:
                for kind, (variant, extra_env) in itertools.product(args.configs, variants):
                    config = workdir / f"{kind}-core{ours}.yaml"
                    write_config(kind, ours, config)
                    ours_server = start_specserve(config, args.port, workdir, extra_env)
                    try:
                        found = asyncio.run(
                            measure(
                                {SPECSERVE: ours_server, VLLM: reference},
                                model_config.name,
                                args,
                                f"{kind} {variant} {placement}",
                            )
                        )
                    finally:
                        ours_server.stop()
                    results.append(
                        {"config": kind, "variant": variant, "cores": f"{ours} / {theirs}", **found}
                    )
                    print(markdown(results[-1:]).splitlines()[-1], flush=True)
            finally:
                reference.stop()
    print(f"\nmachine: {machine()}; engine dtype {fast_dtype()}")
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
