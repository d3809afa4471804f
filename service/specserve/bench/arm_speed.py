"""Per-user speed of every arm on the same prompts, side by side: is a draft configuration faster?

Starts the platform, then for each concurrency level sends the same batches of held-out chat and
coding prompts (never trained on) to every arm in turn, forced with the override header, greedy,
non-streaming. Arms take turns batch by batch (in a rotating order), so all see the same machine
state. Reports per-user output tokens/s (a request's completion tokens over its latency), the
aggregate rate, median latency, and each arm's per-user speed relative to the first arm (the
baseline, `no-spec` in the default config). Acceptance per arm is on the metrics endpoint.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from tqdm import tqdm

from specserve import headers


def run_one(client: httpx.Client, url: str, body: dict, arm: str) -> dict:
    start = time.perf_counter()
    response = client.post(url, json=body, headers={headers.ARM_OVERRIDE: arm})
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    assert response.headers[headers.ARM] == arm
    return {"tokens": response.json()["usage"]["completion_tokens"], "seconds": elapsed}


def measure(
    base_url: str, model: str, arms: list[str], prompts: list, concurrency: int, max_tokens: int
) -> list[dict]:
    url = f"{base_url}/v1/chat/completions"
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    walls: dict[str, float] = dict.fromkeys(arms, 0.0)
    batches = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    with (
        httpx.Client(timeout=600) as client,
        ThreadPoolExecutor(concurrency) as pool,
    ):
        for arm in arms:  # warm-up: first-call paths of every engine
            run_one(client, url, {"model": model, "messages": prompts[0], "max_tokens": 8}, arm)
        for b, batch in enumerate(tqdm(batches, desc=f"concurrency {concurrency}", leave=False)):
            order = arms[b % len(arms) :] + arms[: b % len(arms)]
            for arm in order:
                bodies = [
                    {"model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0}
                    for m in batch
                ]
                start = time.perf_counter()
                results[arm] += pool.map(lambda body, a=arm: run_one(client, url, body, a), bodies)
                walls[arm] += time.perf_counter() - start
    rows = []
    for arm in arms:
        done = results[arm]
        rows.append(
            {
                "arm": arm,
                "concurrency": concurrency,
                "requests": len(done),
                "per_user": statistics.mean(r["tokens"] / r["seconds"] for r in done),
                "aggregate": sum(r["tokens"] for r in done) / walls[arm],
                "p50_s": statistics.median(r["seconds"] for r in done),
            }
        )
    base = rows[0]["per_user"]
    for row in rows:
        row["vs_baseline"] = row["per_user"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set (chat, coding)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--arms", nargs="*", help="arms to compare, baseline first (default: all)")
    args = parser.parse_args(argv)

    from specserve.deploy import Platform
    from specserve.drafter.pipeline import eval_sets
    from specserve.settings import get_settings

    sets = eval_sets(args.prompts)
    prompts = [m for pair in zip(sets["chat"], sets["coding"], strict=False) for m in pair]
    settings = get_settings()
    platform = Platform(settings)
    platform.start()
    try:
        config = platform.loaded.config
        arms = args.arms or [a.name for a in config.arms]
        base_url = f"http://{settings.host}:{settings.port}"
        rows = [
            row
            for c in args.concurrency
            for row in measure(base_url, config.model.name, arms, prompts, c, args.max_tokens)
        ]
    finally:
        platform.stop()
    print(
        "| arm | concurrency | requests | per-user tok/s | vs baseline | aggregate tok/s "
        "| p50 latency |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['arm']} | {r['concurrency']} | {r['requests']} | {r['per_user']:.1f} "
            f"| {r['vs_baseline']:.2f}x | {r['aggregate']:.1f} | {r['p50_s']:.2f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
