"""`specserve bench --together`: every arm serves the same prompts at the same time, each with
the same number of requests in flight from the first measured request to the last of any arm.

Engines that share a core take turns on it whatever their batch, so an arm's figures depend on
what its neighbours do meanwhile. Run as independent benchmark calls, the arms drifted apart:
an arm that finished its warm-up sooner (a drafting arm at two requests) started its prompts
while its neighbour still warmed up, and an arm that finished its prompts sooner left the core
to its neighbour, whose last requests then ran alone on it (docs/bench/serving-speed.md). Here:

1. every arm sends its warm-up requests, and all wait until every arm's are done;
2. every arm starts its prompts at the same moment, `concurrency` at a time, the first requests
   interleaved between the arms;
3. an arm whose prompts have all started keeps `concurrency` requests in flight with the same
   prompts again, not counted, until every arm's prompts are done; those requests are then
   cancelled.

Requests go out through vLLM's serving benchmark's own request function and are measured by it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput,
    RequestFuncOutput,
    async_request_openai_chat_completions,
)

from specserve import headers

# (output tokens, TTFT s, latency s, error) per prompt, as `bench.serving` keeps them.
Row = tuple[int, float, float, str]


class _Client:
    def __init__(self, url: str, model: str, max_tokens: int, session: aiohttp.ClientSession):
        self.url, self.model, self.max_tokens, self.session = url, model, max_tokens, session

    async def send(self, arm: str, messages: list[dict]) -> RequestFuncOutput:
        request = RequestFuncInput(
            prompt="",
            api_url=f"{self.url}/v1/chat/completions",
            prompt_len=0,
            output_len=self.max_tokens,
            model=self.model,
            model_name=self.model,
            extra_headers={headers.ARM_OVERRIDE: arm},
            extra_body={"temperature": 0.0},
            chat_messages=messages,
        )
        return await async_request_openai_chat_completions(request, self.session)


class _Block:
    """One arm's prompts: their rows in prompt order, the next to send, and when the last ended."""

    def __init__(self, prompts: int) -> None:
        self.rows: list[Row | None] = [None] * prompts
        self.pending = iter(range(prompts))
        self.done = asyncio.Event()
        self.end = 0.0


def _row(output: RequestFuncOutput) -> Row:
    if not output.success:
        return (0, 0.0, 0.0, output.error or "failed")
    return (output.output_tokens or 1, output.ttft, output.latency, "")


async def run_together(
    url: str,
    model: str,
    arms: list[str],
    chats: list[list[dict]],
    concurrency: int,
    max_tokens: int,
    warmups: int,
) -> list[tuple[list[Row], tuple[float, float]]]:
    """Per arm, in `arms` order: its rows in prompt order and the (start, end) of its prompts
    on the monotonic clock."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _Client(url, model, max_tokens, session)
        return await serve_together(client.send, arms, chats, concurrency, warmups)


async def serve_together(
    send: Callable[[str, list[dict]], Awaitable[RequestFuncOutput]],
    arms: list[str],
    chats: list[list[dict]],
    concurrency: int,
    warmups: int,
) -> list[tuple[list[Row], tuple[float, float]]]:
    """`run_together`'s schedule, over `send(arm, messages)`."""
    await asyncio.gather(
        *(send(arm, chats[i % len(chats)]) for arm in arms for i in range(warmups))
    )

    async def keep_loaded(arm: str, offset: int) -> None:
        for i in itertools.count(offset, concurrency):
            if not (await send(arm, chats[i % len(chats)])).success:
                return  # a failing arm is not kept busy at the client's pace

    blocks = [_Block(len(chats)) for _ in arms]

    async def user(a: int, slot: int) -> None:
        arm, block = arms[a], blocks[a]
        for i in block.pending:
            block.rows[i] = _row(await send(arm, chats[i]))
            if all(row is not None for row in block.rows):
                block.end = time.monotonic()
                block.done.set()
        # No await between a user's last prompt and its next request: the arm's load never dips.
        await keep_loaded(arm, slot)

    # The first requests go out slot by slot, each slot's arms in an order rotated by one: the
    # server admits a burst in the order it arrives, and no arm's whole first wave may always
    # be the first to reach it.
    start = time.monotonic()
    users = [
        asyncio.create_task(user((slot + j) % len(arms), slot))
        for slot in range(concurrency)
        for j in range(len(arms))
    ]
    await asyncio.gather(*(block.done.wait() for block in blocks))
    for task in users:  # by now each runs an uncounted request
        task.cancel()
    await asyncio.gather(*users, return_exceptions=True)
    return [(block.rows, (start, block.end)) for block in blocks]  # type: ignore[misc]
