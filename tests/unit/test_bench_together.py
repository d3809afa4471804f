"""`bench --together`'s schedule: the same warm-up, start and load for every arm until the last
is done. Requests here are timed sleeps standing in for two arms of different speed; the live
test (tests/integration/test_bench_live.py) runs the same schedule on the real platform."""

from __future__ import annotations

import asyncio
import time

from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

from specserve.bench.together import serve_together

SECONDS = {"fast": 0.01, "slow": 0.03}  # per request


def test_every_arm_starts_together_and_stays_loaded_until_the_last_is_done():
    chats = [[{"role": "user", "content": f"prompt {i}"}] for i in range(6)]
    in_flight = dict.fromkeys(SECONDS, 0)
    log: list[tuple[float, str, str, int]] = []  # (time, arm, event, fast arm's requests in flight)

    async def send(arm: str, messages: list[dict]) -> RequestFuncOutput:
        prompt = chats.index(messages)
        in_flight[arm] += 1
        log.append((time.monotonic(), arm, "start", in_flight["fast"]))
        try:
            await asyncio.sleep(SECONDS[arm])
        finally:
            in_flight[arm] -= 1
        log.append((time.monotonic(), arm, "end", in_flight["fast"]))
        out = RequestFuncOutput(success=True, output_tokens=10 + prompt, ttft=0.001)
        out.latency = SECONDS[arm]
        return out

    blocks = asyncio.run(serve_together(send, list(SECONDS), chats, concurrency=2, warmups=2))

    assert in_flight == {"fast": 0, "slow": 0}  # the uncounted requests were cancelled
    for rows, (start, end) in blocks:
        assert [tokens for tokens, _, _, _ in rows] == [10 + i for i in range(6)]  # in order
        assert start < end
    (_, (fast_start, fast_end)), (_, (slow_start, slow_end)) = blocks
    assert abs(fast_start - slow_start) < 0.005 and fast_end < slow_end
    # The warm-ups (two per arm, at once) all ended before any arm's prompts started.
    assert max(t for t, _, event, _ in log[:8] if event == "end") <= fast_start
    # Whenever the slow arm started or ended a request during its prompts, once both arms' first
    # requests were out, the fast arm, done with its own prompts long before, had its 2 in flight.
    slow = [fast for t, arm, _, fast in log[8 + 4 :] if arm == "slow" and t <= slow_end]
    assert len(slow) >= 10 and all(fast == 2 for fast in slow)
    fast_starts = [t for t, arm, event, _ in log[8:] if arm == "fast" and event == "start"]
    assert len([t for t in fast_starts if t <= slow_end]) > 6  # it kept serving past its own


def test_the_first_requests_alternate_between_the_arms():
    """The server admits a burst in the order it arrives: no arm's first wave may all go first."""
    arms, concurrency = ["a", "b", "c"], 4
    chats = [[{"role": "user", "content": f"prompt {i}"}] for i in range(8)]
    sent: list[str] = []

    async def send(arm: str, messages: list[dict]) -> RequestFuncOutput:
        sent.append(arm)
        await asyncio.sleep(0.001)
        out = RequestFuncOutput(success=True, output_tokens=4, ttft=0.001)
        out.latency = 0.001
        return out

    asyncio.run(serve_together(send, arms, chats, concurrency=concurrency, warmups=1))

    first = sent[len(arms) : len(arms) * (1 + concurrency)]  # after one warm-up per arm
    assert all(sorted(first[i : i + 3]) == arms for i in range(0, len(first), 3))
    mean_position = {arm: sum(i for i, a in enumerate(first) if a == arm) / 4 for arm in arms}
    assert max(mean_position.values()) - min(mean_position.values()) <= 0.5
