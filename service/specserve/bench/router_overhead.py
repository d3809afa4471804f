"""What the router adds to a request: router vs. calling the arm directly, side by side.

Starts the platform with every arm also exposed over HTTP (`/arms/<name>/vllm/v1`, vLLM's own
OpenAI server in the arm's replica), then sends the same tiny request alternately through the
router (the dispatch in the HTTP proxy, forced onto the arm with the override header, then the
arm's specserve front) and straight to vLLM's server in the same replica, so both paths see the
same engine state and machine load. Reports client-side latency percentiles per path and of the
paired differences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx
from tqdm import tqdm

from specserve import headers
from specserve.config.serve_config import ARM_ROUTE_PREFIX
from specserve.engine.front import VLLM_APP_PREFIX


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def timed(client: httpx.Client, url: str, body: dict, hdrs: dict[str, str], stream: bool) -> float:
    """Seconds to the full response (non-streaming) or to the first token chunk (streaming)."""
    start = time.perf_counter()
    if not stream:
        response = client.post(url, json=body, headers=hdrs)
        response.raise_for_status()
        return time.perf_counter() - start
    with client.stream("POST", url, json={**body, "stream": True}, headers=hdrs) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("stream ended without a chunk")


def measure(base_url: str, model: str, arm: str, rounds: int, stream: bool) -> dict:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    router_url = f"{base_url}/v1/completions"
    direct_url = f"{base_url}{ARM_ROUTE_PREFIX}{arm}{VLLM_APP_PREFIX}/v1/completions"
    override = {headers.ARM_OVERRIDE: arm}
    router, direct = [], []
    with httpx.Client(timeout=60) as client:
        for _ in range(10):  # warm-up: connections, caches, first-call paths
            timed(client, router_url, body, override, stream)
            timed(client, direct_url, body, {}, stream)
        for i in tqdm(range(rounds), desc=f"{arm} {'stream' if stream else 'plain'}", leave=False):
            # Alternate which path goes first so neither always follows the other.
            if i % 2:
                direct.append(timed(client, direct_url, body, {}, stream))
                router.append(timed(client, router_url, body, override, stream))
            else:
                router.append(timed(client, router_url, body, override, stream))
                direct.append(timed(client, direct_url, body, {}, stream))
    diffs = [r - d for r, d in zip(router, direct, strict=True)]
    ms = 1000.0
    return {
        "arm": arm,
        "mode": "stream TTFT" if stream else "non-stream",
        "n": rounds,
        "direct_p50": percentile(direct, 50) * ms,
        "direct_p99": percentile(direct, 99) * ms,
        "router_p50": percentile(router, 50) * ms,
        "router_p99": percentile(router, 99) * ms,
        "added_p50": (percentile(router, 50) - percentile(direct, 50)) * ms,
        "added_p99": (percentile(router, 99) - percentile(direct, 99)) * ms,
        "paired_median": statistics.median(diffs) * ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="request pairs per arm and mode")
    parser.add_argument("--arms", nargs="*", help="arms to measure (default: all in the config)")
    args = parser.parse_args(argv)

    os.environ["SPECSERVE_EXPOSE_ARMS"] = "1"
    from specserve.config.settings import get_settings
    from specserve.deploy import Platform

    settings = get_settings()
    platform = Platform(settings)
    platform.start()
    try:
        config = platform.loaded.config
        base_url = f"http://{settings.host}:{settings.port}"
        rows = [
            measure(base_url, config.model.name, arm, args.rounds, stream)
            for arm in (args.arms or [a.name for a in config.arms])
            for stream in (False, True)
        ]
    finally:
        platform.stop()
    print(
        "| arm | mode | n | direct p50 | router p50 | added p50 | direct p99 | router p99 "
        "| added p99 | paired median |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['arm']} | {r['mode']} | {r['n']} | {r['direct_p50']:.2f} ms "
            f"| {r['router_p50']:.2f} ms | {r['added_p50']:+.2f} ms | {r['direct_p99']:.2f} ms "
            f"| {r['router_p99']:.2f} ms | {r['added_p99']:+.2f} ms "
            f"| {r['paired_median']:+.2f} ms |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
