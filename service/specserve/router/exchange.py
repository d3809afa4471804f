"""One request's trip from the dispatch to its arm and back (router/dispatch.py sends it): what
the client is sent (the arm's answer with the dispatch's headers; Ray Serve's own refusals and
lost replicas as OpenAI errors; a stream cut mid-way ended with an error event), and what the
router records of it (status, usage, first token, outcome)."""

from __future__ import annotations

import json
import logging
import re
import time
from enum import Enum
from typing import Any

from specserve import headers
from specserve.metrics import OUTCOME_CANCELLED, OUTCOME_SERVER_ERROR
from specserve.router.record import REJECTED_STATUSES, RequestRecord, outcome_of_status
from specserve.router.replays import Fate
from specserve.wire.arm_calls import ASGIApp, Message, Receive, Scope, Send
from specserve.wire.errors import (
    MID_STREAM_FAILURE,
    OVERLOAD_RETRY_AFTER_S,
    OVERLOAD_STATUS,
    SSE_DONE,
    OpenAIError,
    arm_overloaded,
    error_body,
    error_event,
)
from specserve.wire.resume import ResumePoint, resume_point

logger = logging.getLogger(__name__)

ARM = headers.ARM.encode()
_USAGE = headers.USAGE.encode()
_SSE_EVENT_END = b"\n\n"
_ERROR_EVENT = b'data: {"error"'
_SSE_DONE = SSE_DONE.encode()
# The usage chunk an arm ends its stream with: `usage` and no choices, whatever the JSON's
# spacing or key order. The pattern only picks the events worth parsing.
_MAYBE_USAGE = re.compile(rb'"choices"\s*:\s*\[\s*\]')


class Answer(Enum):
    """Who has answered an exchange so far: the arm (its answer names it in a header) or Ray
    Serve in its place (a full queue, no replica, no application), told apart on the first
    message."""

    NONE = "none"  # nothing yet: the replica may still answer, or it died first
    ARM = "arm"  # the arm's answer began
    ARM_ENDED = "arm ended"  # and its last part came
    RAY_SERVE = "ray serve"  # Ray Serve's own response: held back, answered as an OpenAI error


class Exchange:
    """One request's trip to its arm and back: what the client is sent, and what the router
    records of it."""

    def __init__(
        self,
        record: RequestRecord,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        request_id: tuple[bytes, bytes],
        *,
        client_wants_usage: bool,
        endpoint: str | None = None,
        resumes: Exchange | None = None,
        show_arm: bool = True,
    ) -> None:
        self.record = record
        self.send = send
        self.extra = extra  # on every answer (the arm's get the request id from Ray Serve)
        self.show_arm = show_arm  # the arm's own header reaches the client
        self.request_id = request_id
        self.client_wants_usage = client_wants_usage
        self.answer = Answer.NONE
        self.refusal: Message | None = None  # Ray Serve's response start, when it answered
        self.status = 0
        self.stream = False  # the answer is an event stream
        self.client_gone = False
        # A resumable stream's endpoint, and what the stream has sent the client (to resume it
        # from, if its replica dies mid-way); the exchange this one resumes, if it does.
        self.endpoint: str | None = resumes.endpoint if resumes else endpoint
        self.sent: list[bytes] = resumes.sent if resumes else []
        self.resumes = resumes is not None

    @property
    def started(self) -> bool:
        """A response began: the arm's, or Ray Serve's in its place."""
        return self.answer is not Answer.NONE

    def unanswered(self) -> bool:
        """Whether neither the arm nor a replica of it answered: its replica died before
        answering, or Ray Serve found no replica (503) or no application (404) for it."""
        if self.answer is Answer.NONE:
            return True
        return self.answer is Answer.RAY_SERVE and self.status in (404, 503)

    def fate(self) -> Fate:
        """How this exchange went, as a replay: answered to the end, its replica lost before or
        while answering, or nothing learnt (the client left; Ray Serve refused it)."""
        if self.client_gone or self.answer is Answer.RAY_SERVE:
            return Fate.UNKNOWN
        return Fate.ANSWERED if self.answer is Answer.ARM_ENDED else Fate.REPLICA_DIED

    async def run(self, app: ASGIApp, scope: Scope, raw: bytes, receive: Receive) -> None:
        replayed = False

        async def receive_body() -> Message:
            nonlocal replayed
            if not replayed:  # the body was read to route the request: hand it on once
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
            return message

        await app(scope, receive_body, self._send)

    def cut_at(self) -> ResumePoint | None:
        """Where a resumable stream stands that its replica cut mid-way (None for any other
        request, and for a stream whose answer had ended: only its end was lost)."""
        if self.endpoint is None or not self.stream or self.answer is not Answer.ARM:
            return None
        point = resume_point(b"".join(self.sent), self.endpoint)
        return None if point is None or point.finished else point

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            response_headers = list(message.get("headers") or ())
            if not any(name == ARM for name, _ in response_headers):
                self.answer, self.refusal = Answer.RAY_SERVE, message
                return
            self.answer = Answer.ARM
            if self.resumes:  # the client has the first stream's start
                self.stream = self.status == 200
                return
            kept = []
            for name, value in response_headers:
                if name == _USAGE:
                    self._read_usage(value)
                elif name == ARM and not self.show_arm:
                    continue
                elif name == self.request_id[0]:
                    continue  # the dispatch's own, below: one id per answer
                elif name == b"content-type" and value.startswith(b"text/event-stream"):
                    self.stream = True
                    kept.append((name, value))
                else:
                    kept.append((name, value))
            message["headers"] = [
                *kept,
                *(h for h in self.extra if h[0] != ARM),
                self.request_id,  # as Ray Serve's replicas answer it
            ]
        elif kind == "http.response.body":
            if self.answer is Answer.RAY_SERVE:
                return
            if not message.get("more_body", False):
                self.answer = Answer.ARM_ENDED
            if self.resumes and not self.stream:
                return
            if self.stream:
                if self.endpoint is not None:
                    self.sent.append(message.get("body", b""))
                message["body"] = self._observe_events(message.get("body", b""))
        await self.send(message)

    def _observe_events(self, body: bytes) -> bytes:
        if self.record.first_token_at is None and body:
            self.record.first_token_at = time.perf_counter()
        if body.startswith(_ERROR_EVENT):  # the arm cut the stream short
            self.record.outcome = OUTCOME_SERVER_ERROR
        if b'"usage"' not in body:
            return body
        kept = []
        for event in body.split(_SSE_EVENT_END):
            payload = self._usage_chunk(event)
            if payload is not None:
                self.record.read_usage(payload.get("usage"), payload.get("metrics"))
                if not self.client_wants_usage:
                    continue
            kept.append(event)
        return _SSE_EVENT_END.join(kept)

    def _usage_chunk(self, event: bytes) -> dict[str, Any] | None:
        """The payload of `event` if it is the usage chunk (`data: {...}` with `usage` and
        empty `choices`), else None."""
        if b'"usage"' not in event or not _MAYBE_USAGE.search(event):
            return None
        data = event.strip()
        if not data.startswith(b"data:"):
            return None
        try:
            payload = json.loads(data.removeprefix(b"data:"))
        except ValueError:
            logger.warning("unparseable usage from arm %s", self.record.arm)
            return None
        if isinstance(payload, dict) and payload.get("choices") == [] and "usage" in payload:
            return payload
        return None

    def _read_usage(self, value: bytes) -> None:
        try:
            payload = json.loads(value)
        except ValueError:
            logger.warning("unparseable usage from arm %s", self.record.arm)
            return
        self.record.read_usage(payload.get("usage"), payload.get("metrics"))

    async def finish(self) -> None:
        """After the arm (or Ray Serve) is done: settle the outcome, answer what is unanswered."""
        record = self.record
        if self.resumes and not (self.stream and self.answer is Answer.ARM_ENDED):
            await self._cut()
        elif self.answer is Answer.RAY_SERVE:
            record.outcome = outcome_of_status(await self._answer_refusal())
        elif self.answer is Answer.NONE:
            if self.client_gone:
                record.outcome = OUTCOME_CANCELLED
                return
            record.outcome = OUTCOME_SERVER_ERROR
            error = OpenAIError(
                503,
                f"arm {record.arm!r} failed twice for this request; retry later",
                code="engine_unavailable",
                headers={headers.RETRY_AFTER: "1"},
            )
            await send_error(self.send, error, [*self.extra, self.request_id])
        elif self.answer is Answer.ARM:  # its answer began and did not end
            await self._cut()
        elif self.status >= 400:
            record.outcome = outcome_of_status(self.status)
        # Otherwise ok, or a stream the arm cut short with an error event (already recorded).

    async def _cut(self) -> None:
        """End a stream the arm did not finish with an error event, never silently (a JSON answer
        cut short can only end); one whose answer had ended with `[DONE]` (only that was lost)."""
        if self.client_gone:
            self.record.outcome = OUTCOME_CANCELLED
            return
        point = resume_point(b"".join(self.sent), self.endpoint) if self.endpoint else None
        if point is not None and point.finished:
            end = _SSE_DONE
        else:
            self.record.outcome = OUTCOME_SERVER_ERROR
            logger.warning("arm %s: the answer was cut mid-way", self.record.arm)
            cut = self.stream or self.resumes
            end = error_event(500, MID_STREAM_FAILURE).encode() if cut else b""
        await self.send({"type": "http.response.body", "body": end, "more_body": False})

    async def _answer_refusal(self) -> int:
        """Ray Serve answered instead of the arm: its queue was full (429), no replica could
        take the request (503), or the arm's application is gone (404)."""
        assert self.refusal is not None
        status = self.status
        ray_headers = dict(self.refusal.get("headers") or ())
        retry_after = ray_headers.get(
            headers.RETRY_AFTER.encode(), str(OVERLOAD_RETRY_AFTER_S).encode()
        ).decode()
        arm = self.record.arm
        if status == OVERLOAD_STATUS:
            error = arm_overloaded(arm, retry_after)
        elif status in REJECTED_STATUSES or status == 404:
            error = OpenAIError(
                503,
                f"arm {arm!r} has no replica to take the request; retry shortly",
                code="engine_unavailable",
                headers={headers.RETRY_AFTER: retry_after},
            )
        else:
            logger.error("arm %s: Ray Serve answered %d", arm, status)
            error = internal_error()
        await send_error(self.send, error, [*self.extra, self.request_id])
        return error.status


def internal_error() -> OpenAIError:
    return OpenAIError(500, "Internal Server Error", type="server_error")


async def send_json(
    send: Send, status: int, payload: dict[str, Any], extra: list[tuple[bytes, bytes]]
) -> None:
    body = json.dumps(payload).encode()
    response_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: OpenAIError, extra: list[tuple[bytes, bytes]]) -> None:
    body = error_body(
        error.status, error.message, param=error.param, code=error.code, type=error.type
    )
    more = [(k.encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send_json(send, error.status, body, [*extra, *more])
