"""Client disconnects cancel their engine requests: streams closed mid-generation, then how long
until the engines are idle again.

Starts the platform (the config in SPECSERVE_CONFIG, as `specserve serve`) with Ray exporting
metrics every 250 ms, opens `--streams` streams `--concurrency` at a time on one arm, reads two
tokens of each and hangs up. Then it polls vLLM's own gauges on the metrics port — running
requests and KV-cache use — until they are back to their baseline, and reports that time, how
many tokens the engines generated of those asked, and a probe request's latency before and after.

    python -m specserve.bench.cancellation --streams 1000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import httpx
from tqdm import tqdm

from specserve import headers
from specserve.metrics import scrape

EXPORT_INTERVAL_MS = 250
RUNNING = "ray_vllm_num_requests_running"
KV_CACHE = "ray_vllm_kv_cache_usage_perc"
GENERATED = "ray_vllm_generation_tokens_total"
SETTLE_TIMEOUT_S = 60.0
WARM_UP_S = 10.0


def engine_gauges(metrics_url: str) -> dict[str, float]:
    """Running requests (summed over engines), KV-cache use (the largest) and tokens generated
    (summed). vLLM's gauges are absent while an engine is idle (Ray drops a series that stops
    changing): absent counts as idle, 0."""
    values = {RUNNING: 0.0, KV_CACHE: 0.0, GENERATED: 0.0}
    for _, sample in scrape(metrics_url):
        if sample.name == KV_CACHE:
            values[KV_CACHE] = max(values[KV_CACHE], sample.value)
        elif sample.name in (RUNNING, GENERATED):
            values[sample.name] += sample.value
    return values


async def cancel_one(client: httpx.AsyncClient, body: dict, arm: str) -> None:
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={headers.ARM_OVERRIDE: arm}
    ) as response:
        response.raise_for_status()
        tokens = 0
        async for line in response.aiter_lines():
            tokens += '"content":"' in line
            if tokens == 2:
                return  # leaving the block closes the connection mid-stream


async def cancel_streams(base_url: str, body: dict, arm: str, streams: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        progress = tqdm(total=streams, desc=f"streams cancelled on {arm}")

        async def one() -> None:
            async with gate:
                await cancel_one(client, body, arm)
                progress.update()

        await asyncio.gather(*(one() for _ in range(streams)))
        progress.close()


def probe_s(base_url: str, model: str, arm: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    started = time.perf_counter()
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json=body,
        headers={headers.ARM_OVERRIDE: arm},
        timeout=120,
    )
    response.raise_for_status()
    return time.perf_counter() - started


def wait_until_idle(metrics_url: str, baseline: dict[str, float]) -> tuple[float, dict]:
    """Seconds from now until running requests and KV-cache use are at their baseline."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_TIMEOUT_S:
        now = engine_gauges(metrics_url)
        if now[RUNNING] <= baseline[RUNNING] and now[KV_CACHE] <= baseline[KV_CACHE]:
            return time.monotonic() - started, now
        time.sleep(EXPORT_INTERVAL_MS / 1000 / 2)
    raise TimeoutError(f"engines still busy {SETTLE_TIMEOUT_S:.0f} s after the last cancel: {now}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--arm", default="no-spec")
    parser.add_argument("--max-tokens", type=int, default=400, help="asked per stream")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_metrics_report_interval_ms", str(EXPORT_INTERVAL_MS))
    from specserve.config.settings import get_settings
    from specserve.deploy import Platform

    settings = get_settings()
    platform = Platform(settings)
    platform.start()
    try:
        model = platform.loaded.config.model.name
        base_url = f"http://{settings.host}:{settings.port}"
        metrics_url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
        for _ in range(3):  # warm-up: first-call paths, and Ray's agents finish starting
            probe_s(base_url, model, args.arm)
        time.sleep(WARM_UP_S)
        probe_before = min(probe_s(base_url, model, args.arm) for _ in range(5))
        time.sleep(3 * EXPORT_INTERVAL_MS / 1000)
        baseline = engine_gauges(metrics_url)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Write a long story about the sea."}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.monotonic()
        asyncio.run(cancel_streams(base_url, body, args.arm, args.streams, args.concurrency))
        cancelling_s = time.monotonic() - started
        settle_s, settled = wait_until_idle(metrics_url, baseline)
        probe_after = min(probe_s(base_url, model, args.arm) for _ in range(5))
    finally:
        platform.stop()
    generated = settled[GENERATED] - baseline[GENERATED]
    asked = args.streams * args.max_tokens
    print(
        f"| arm | streams | concurrency | cancelling took | engines idle after the last cancel "
        f"| tokens generated / asked | probe before | probe after |\n"
        f"| --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {args.arm} | {args.streams} | {args.concurrency} | {cancelling_s:.1f} s "
        f"| {settle_s:.2f} s (metrics every {EXPORT_INTERVAL_MS} ms) "
        f"| {generated:.0f} / {asked} ({generated / asked:.1%}) "
        f"| {probe_before * 1000:.0f} ms | {probe_after * 1000:.0f} ms |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
