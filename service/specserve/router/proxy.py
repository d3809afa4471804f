"""Forward one request to an arm's engine and record what happened, per arm.

Streams pass through chunk by chunk. The router always asks the engine for the final usage chunk
(it carries the token count and vLLM's per-request speculative-decoding stats) and drops it again
when the client did not ask for usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response, StreamingResponse
from ray.serve.handle import DeploymentHandle

from specserve.metrics import (
    OUTCOME_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_SERVER_ERROR,
    RouterMetrics,
)
from specserve.router.errors import OpenAIError

logger = logging.getLogger(__name__)

_SSE_DONE = "data: [DONE]"


@dataclass
class RequestRecord:
    """What one request did on its arm; turned into metrics when it ends."""

    arm: str
    endpoint: str
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_tokens: int = 0
    spec_decode: dict[str, Any] | None = None
    outcome: str = OUTCOME_OK

    def finish(self, metrics: RouterMetrics) -> None:
        now = time.perf_counter()
        metrics.count_request(self.arm, self.endpoint, self.outcome)
        if self.outcome != OUTCOME_OK:
            return
        ttft_s = tpot_s = None
        if self.first_token_at is not None:
            ttft_s = self.first_token_at - self.started
            if self.output_tokens > 1:
                tpot_s = (now - self.first_token_at) / (self.output_tokens - 1)
        metrics.observe_request(
            self.arm,
            e2e_s=now - self.started,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            output_tokens=self.output_tokens,
        )
        if self.spec_decode:
            metrics.observe_spec_decode(self.arm, self.spec_decode)

    def read_usage(self, usage: dict | None, extra_metrics: dict | None) -> None:
        if usage:
            self.output_tokens = int(usage.get("completion_tokens") or 0)
        if extra_metrics:
            self.spec_decode = extra_metrics.get("speculative_decoding")


def _engine_error(chunk: Any) -> Any | None:
    """The error detail if the engine answered with an ErrorResponse (vLLM's or Ray's class)."""
    return getattr(chunk, "error", None)


def _raise_engine_error(status: int, detail: Any) -> None:
    if status >= 500:
        logger.error("engine error %s: %s", status, detail.message)
        raise OpenAIError(status, "Internal Server Error", type="server_error")
    raise OpenAIError(status, detail.message, type=detail.type, param=detail.param)


async def forward(
    handle: DeploymentHandle,
    method: str,
    body: Any,
    record: RequestRecord,
    metrics: RouterMetrics,
    *,
    client_wants_usage: bool,
    headers: dict[str, str],
    timeout_s: float,
) -> Response:
    """Call `method` (chat or completions) on the arm and build the HTTP response."""
    generator = getattr(handle, method).remote(body, None)
    try:
        async with asyncio.timeout(timeout_s):
            first = await generator.__anext__()
    except TimeoutError:
        generator.cancel()
        record.outcome = OUTCOME_SERVER_ERROR
        record.finish(metrics)
        raise OpenAIError(504, f"no response from the model within {timeout_s:g} s") from None
    except Exception:
        record.outcome = OUTCOME_SERVER_ERROR
        record.finish(metrics)
        raise
    chunk = first[0] if isinstance(first, list) else first
    error = _engine_error(chunk)
    if error is not None:
        generator.cancel()
        status = int(error.code) if str(error.code).isdigit() else 500
        record.outcome = OUTCOME_CLIENT_ERROR if status < 500 else OUTCOME_SERVER_ERROR
        record.finish(metrics)
        _raise_engine_error(status, error)

    if not getattr(body, "stream", False):
        payload = chunk.model_dump(mode="json", exclude_none=True)
        record.read_usage(payload.get("usage"), payload.get("metrics"))
        record.finish(metrics)
        return Response(json.dumps(payload), media_type="application/json", headers=headers)

    return StreamingResponse(
        _stream(first, generator, record, metrics, client_wants_usage),
        media_type="text/event-stream",
        headers=headers,
    )


async def _stream(
    first: Any,
    rest: AsyncIterator[Any],
    record: RequestRecord,
    metrics: RouterMetrics,
    client_wants_usage: bool,
) -> AsyncIterator[str]:
    record.first_token_at = time.perf_counter()
    done_sent = False
    try:
        item = first
        while True:
            for event in item if isinstance(item, list) else [item]:
                text = event if isinstance(event, str) else f"data: {event.model_dump_json()}\n\n"
                if '"usage"' in text and '"choices":[]' in text:
                    _read_usage_event(text, record)
                    if not client_wants_usage:
                        continue
                if text.startswith(_SSE_DONE):
                    done_sent = True
                yield text
            try:
                item = await rest.__anext__()
            except StopAsyncIteration:
                break
        if not done_sent:
            yield f"{_SSE_DONE}\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        record.outcome = OUTCOME_CANCELLED
        raise
    except Exception:
        # Headers are gone; all the client can get is a truncated stream and our log line.
        record.outcome = OUTCOME_SERVER_ERROR
        logger.exception("stream from arm %s failed", record.arm)
        raise
    finally:
        if record.outcome != OUTCOME_OK and hasattr(rest, "cancel"):
            rest.cancel()
        record.finish(metrics)


def _read_usage_event(text: str, record: RequestRecord) -> None:
    try:
        payload = json.loads(text.removeprefix("data: ").strip())
    except ValueError:
        logger.warning("unparseable usage chunk from arm %s", record.arm)
        return
    record.read_usage(payload.get("usage"), payload.get("metrics"))
