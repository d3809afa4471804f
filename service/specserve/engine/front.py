"""An arm's OpenAI front: the HTTP app of the arm's engine replica, which the dispatch (the router
in each HTTP proxy) routes requests to.

It validates the request schema (wire/validation.py) and runs it on the replica's own engine,
in process: a stream passes through chunk by chunk and always ends with the usage chunk (the
token count and vLLM's per-request speculative-decoding stats, which the dispatch records and
drops when the client did not ask for usage); a non-streaming answer carries the same in an
internal header. Every answer names the arm, which is how the dispatch tells the arm's answers
from Ray Serve's own. The request's time limit comes from the dispatch, and so does the resume
point of a stream whose first replica died mid-way: the front then streams the rest of that
answer as the continuation of the first stream (wire/resume.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.llm import LLMConfig, LLMServer

from specserve import headers
from specserve.capture.store import Bounds, CaptureWriter, Sampled
from specserve.capture.tap import Tap, sampling_of
from specserve.config.schema import RELOADED_IN_PLACE
from specserve.config.settings import get_settings
from specserve.engine.drafter_reload import RELOAD_DRAFTER, local_checkpoint
from specserve.engine.serve_log import keep_serve_log_targets
from specserve.metrics import CaptureMetrics
from specserve.models import resolve_drafter_source
from specserve.wire.arm_calls import serve_app
from specserve.wire.errors import (
    MID_STREAM_FAILURE,
    SSE_DONE,
    OpenAIError,
    error_event,
    install_error_handlers,
    request_id,
)
from specserve.wire.requests import CHAT, COMPLETIONS, PATHS, parse_body
from specserve.wire.resume import ResumedStream, ResumePoint, continue_request
from specserve.wire.validation import validate_request

logger = logging.getLogger(__name__)

_SSE_DONE = SSE_DONE.strip()
# Under the arm's route, where an arm deployed with `expose_http` also serves vLLM's own OpenAI
# app (what the router-overhead benchmark compares against).
VLLM_APP_PREFIX = "/vllm"
# A request that reaches the arm without the dispatch's time limit (an exposed arm's own route).
DEFAULT_TIMEOUT_S = 600.0
(DRAFTER_WEIGHTS,) = RELOADED_IN_PLACE  # the key of the arm's `user_config`


class ArmServer(LLMServer):
    """Ray Serve LLM's engine server with specserve's OpenAI front as its HTTP app."""

    async def __init__(self, llm_config: LLMConfig, *, arm: str, expose_vllm: bool = False):  # type: ignore[misc]  # Serve awaits an async constructor
        self.arm = arm
        self.expose_vllm = expose_vllm
        self.model = llm_config.model_id
        self._capture_writer: CaptureWriter | None = None
        self._front: FastAPI | None = None  # built by Ray Serve's ingress, before any request
        spec = llm_config.engine_kwargs.get("speculative_config") or {}
        # The drafter checkpoint the engine started with (its hub commit, if one), and the one
        # whose weights it runs.
        self._drafter = self._drafter_weights = spec.get("model")
        self._drafter_revision = spec.get("revision")
        with keep_serve_log_targets():  # the engine's start closes the replica's log handlers
            await super().__init__(llm_config)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve's in-place update of the running replica (its `user_config`, which
        `ArmConfig.deployment_options` writes): the drafter weights to run, loaded into the
        running engine between two of its steps (engine/drafter_reload.py). A failed load is
        logged and the engine serves on with the weights it had: failing here would make Ray
        Serve replace the replica, engine and all."""
        if self._drafter is None:
            return
        wanted = user_config.get(DRAFTER_WEIGHTS)
        try:
            path = resolve_drafter_source(wanted) if wanted else self._drafter
            if path == self._drafter_weights:
                return
            started = time.monotonic()
            started_from = await asyncio.to_thread(
                local_checkpoint, self._drafter, self._drafter_revision
            )
            await self.collective_rpc(RELOAD_DRAFTER, args=(path, started_from))
        except Exception as exc:
            logger.error(
                "arm %s: drafter weights %s not loaded (%s); the engine keeps %s",
                self.arm,
                wanted,
                exc,
                self._drafter_weights,
            )
            return
        self._drafter_weights = path
        took = time.monotonic() - started
        logger.info("arm %s: drafter weights %s loaded in %.1f s", self.arm, path, took)

    async def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title=f"specserve arm {self.arm}", docs_url=None, openapi_url=None)
        install_error_handlers(app, headers={headers.ARM: self.arm})

        @app.post(PATHS[CHAT])
        async def chat(request: Request) -> Response:
            return await self._serve(request, CHAT)

        @app.post(PATHS[COMPLETIONS])
        async def completions(request: Request) -> Response:
            return await self._serve(request, COMPLETIONS)

        if self.expose_vllm:
            app.mount(VLLM_APP_PREFIX, await super().__serve_build_asgi_app__())
        self._front = app
        return app

    async def dispatched(self, request: bytes) -> AsyncIterator[bytes]:
        """A request from the dispatch, over a Ray Serve handle (wire/arm_calls.py): served by
        the front's app, in this replica, as if it had come through Ray Serve's HTTP path."""
        if self._front is None:
            raise RuntimeError("the arm's front is not built yet")
        async for messages in serve_app(self._front, request):
            yield messages

    async def _serve(self, request: Request, endpoint: str) -> Response:
        answer_headers = {headers.ARM: self.arm}
        try:
            data = parse_body(await request.body())
            body = validate_request(data, endpoint)
            if endpoint == CHAT:
                # The messages as plain JSON, as the engine has always been given them: the
                # validated ones can hold one-shot pydantic iterators.
                body.messages = data["messages"]
            timeout_s = float(request.headers.get(headers.REQUEST_TIMEOUT_S, DEFAULT_TIMEOUT_S))
            resumed = await self._resume(request.headers.get(headers.RESUME_FROM), body, endpoint)
            tap = (
                None if resumed else self._tap(request.headers.get(headers.CAPTURE), body, endpoint)
            )
            # LLMServer.chat / .completions: the replica's engine, in this process.
            generator = await getattr(self, endpoint)(body, None)
            return await respond(generator, body, answer_headers, timeout_s, resumed, tap)
        except OpenAIError as exc:
            exc.headers = {**answer_headers, **(exc.headers or {})}  # the arm answered
            raise

    def _tap(self, value: str | None, body: Any, endpoint: str) -> CaptureTap | None:
        """A request in the arm's capture sample (the dispatch drew it): vLLM is asked for its
        token ids, which the tap takes from the answer and hands to this replica's writer."""
        if value is None:
            return None
        try:
            sampled = Sampled.from_header(value)
        except ValueError:
            logger.warning("request %s: unreadable capture bounds; not captured", request_id())
            return None
        client_asked = bool(getattr(body, "return_token_ids", False))
        body.return_token_ids = True
        return CaptureTap(
            self._writer(),
            sampled.bounds,
            Tap(
                self.arm,
                endpoint,
                client_asked=client_asked,
                stream=bool(getattr(body, "stream", False)),
                sampling=sampling_of(body),
                key=sampled.key,
                prompt_digest=sampled.prompt_digest,
            ),
        )

    def _writer(self) -> CaptureWriter:
        if self._capture_writer is None:
            metrics = CaptureMetrics(self.model, self.arm)
            self._capture_writer = CaptureWriter(
                get_settings().capture_path(),
                self.arm,
                serve.get_replica_context().replica_id.unique_id,
                on_written=metrics.count_written,
                on_dropped=metrics.count_dropped,
            )
        return self._capture_writer

    async def _resume(self, value: str | None, body: Any, endpoint: str) -> ResumedStream | None:
        """A stream the dispatch resumes after its first replica died: the request turned into
        the rest of its answer (wire/resume.py)."""
        if value is None:
            return None
        point = ResumePoint.from_header(value)
        if not getattr(body, "stream", False):
            raise OpenAIError(400, "only a stream can be resumed")
        prior_tokens = 0
        if point.text:
            # The engine's own tokenizer (LLMServer.tokenize is unavailable with vLLM 0.32: Ray
            # Serve LLM 2.60 looks its tokenization service up under an older name).
            client = getattr(self.engine, "_engine_client", None)
            if client is None:
                logger.error("request %s: no tokenizer to resume a stream with", request_id())
                raise OpenAIError(503, "the stream cannot be resumed here", code="no_tokenizer")
            # On the event loop: once per resumed stream (a thread could meet a Rust tokenizer
            # that the engine is using at the same time).
            ids = client.get_tokenizer().encode(point.text, add_special_tokens=False)
            prior_tokens = len(ids)
        continue_request(body, endpoint, point, prior_tokens)
        logger.info("request %s: resuming a stream after %d tokens", request_id(), prior_tokens)
        return ResumedStream(point, endpoint, prior_tokens)


class CaptureTap:
    """A sampled request's tap and where its records go once its answer has ended."""

    def __init__(self, writer: CaptureWriter, bounds: Bounds, tap: Tap) -> None:
        self.writer, self.bounds, self.tap = writer, bounds, tap

    def take_event(self, text: str) -> str:
        """A stream event with the token ids taken out ('' for one left with nothing)."""
        if not text.startswith("data: {"):
            return text
        try:
            payload = json.loads(text[len("data: ") :])
        except ValueError:  # not vLLM's: pass it on as it is, the capture is what suffers
            logger.warning("request %s: an event the capture cannot read", request_id())
            return text
        keep = self.tap.take(payload)
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n" if keep else ""

    def keep(self) -> None:
        for record in self.tap.records():
            self.writer.put(record, self.bounds)


async def respond(
    generator: AsyncIterator[Any],
    body: Any,
    answer_headers: dict[str, str],
    timeout_s: float,
    resumed: ResumedStream | None = None,
    capture: CaptureTap | None = None,
) -> Response:
    """The HTTP response for the engine's output; `timeout_s` bounds the whole request, a stream
    included; a resumed stream's events continue the stream it resumes; a sampled request's
    token ids go to the capture store, once its answer has ended."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout_at(deadline) as limit:
            first = await anext(generator)
        if limit.expired():  # vLLM caught the cancellation and answered "Client disconnected"
            raise TimeoutError
    except TimeoutError:
        await _close(generator)
        raise OpenAIError(504, f"no response from the model within {timeout_s:g} s") from None
    chunk = first[0] if isinstance(first, list) else first
    error = getattr(chunk, "error", None)  # an ErrorResponse (vLLM's or Ray's class)
    if error is not None:
        await _close(generator)
        status = int(error.code) if str(error.code).isdigit() else 500
        if status >= 500:
            # Its code and type, not its text: an engine's message may quote the prompt.
            logger.error("request %s: engine error %s (%s)", request_id(), status, error.type)
            raise OpenAIError(status, "Internal Server Error", type="server_error")
        # OpenAI's type for the status, as the router's own refusals carry: vLLM names its
        # exception class there ("BadRequestError").
        raise OpenAIError(status, error.message, param=error.param)

    if not getattr(body, "stream", False):
        payload = chunk.model_dump(mode="json", exclude_none=True)
        if capture is not None:
            capture.tap.take(payload)
            capture.keep()
        usage = {"usage": payload.get("usage"), "metrics": payload.get("metrics")}
        return Response(
            json.dumps(payload),
            media_type="application/json",
            headers={**answer_headers, headers.USAGE: json.dumps(usage)},
        )
    return StreamingResponse(
        _stream(first, generator, deadline, timeout_s, resumed, capture),
        media_type="text/event-stream",
        headers=answer_headers,
    )


async def _stream(
    first: Any,
    rest: AsyncIterator[Any],
    deadline: float,
    timeout_s: float,
    resumed: ResumedStream | None = None,
    capture: CaptureTap | None = None,
) -> AsyncIterator[str]:
    """Pass the stream through. It always ends with `[DONE]`; one cut short (timeout, a failed
    engine) ends with an OpenAI error event first, never silently (and is not captured)."""
    done_sent = False
    try:
        item = first
        while True:
            for event in item if isinstance(item, list) else [item]:
                text = event if isinstance(event, str) else f"data: {event.model_dump_json()}\n\n"
                if text.startswith(_SSE_DONE):
                    done_sent = True
                elif resumed is not None:
                    text = resumed.rewrite(text)
                elif capture is not None:
                    text = capture.take_event(text)
                if text:
                    yield text
            try:
                async with asyncio.timeout_at(deadline) as limit:
                    item = await anext(rest)
                if limit.expired():  # the engine caught the cancellation and answered
                    raise TimeoutError
            except StopAsyncIteration:
                break
        if capture is not None:
            capture.keep()
        if not done_sent:
            yield SSE_DONE
    except TimeoutError:
        logger.warning("request %s: stream cut at %g s", request_id(), timeout_s)
        yield error_event(504, f"the request ran longer than {timeout_s:g} s and was stopped")
    except Exception:
        # The status line is sent; the client learns of the failure from the error event.
        logger.exception("request %s: stream failed", request_id())
        yield error_event(500, MID_STREAM_FAILURE)
    finally:
        await _close(rest)


async def _close(generator: AsyncIterator[Any]) -> None:
    """End the engine's generator, which aborts the request in the engine if it still runs."""
    close = getattr(generator, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            logger.debug("closing the engine's stream failed", exc_info=True)
