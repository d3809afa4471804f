"""Resuming a stream whose arm replica died mid-answer, spoken by both sides.

The dispatch keeps what a resumable stream has sent the client. When the replica dies before the
stream ends, it sends the request once more (the one replay any request gets) with a resume
point in an internal header: the text generated so far and the stream's id. The arm's front
continues the answer from that text (a chat's assistant message continued, a completion's prompt
extended, the token limit less the tokens already sent) and streams only the rest, under the
first stream's id. The client sees one stream.

Resumable: streams of one choice whose deltas are plain text, with no structured output or tools
(a grammar or a tool parser would start again from the beginning) and, for completions, one
string prompt without `echo` or `suffix`. The tokens already sent are counted again by the arm's
tokenizer, so the token limit holds to within what a re-tokenization changes (a token or two).
Sampling goes on from a new random state: the resumed answer is a sample of the same model, not
the sample the dead replica would have drawn.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from specserve.wire.errors import SSE_DONE, OpenAIError
from specserve.wire.requests import CHAT

# Request fields that make a stream not resumable.
_NOT_RESUMABLE = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "functions",
    "echo",
    "suffix",
    "best_of",
)
_EVENT_END = b"\n\n"
_DATA = b"data: "
# What a chat delta may hold for its stream to be resumable: the role (first chunk) and text.
_PLAIN_DELTA = frozenset({"role", "content"})


def resumable(data: dict[str, Any], endpoint: str) -> bool:
    """Whether a request's stream can be resumed if its replica dies mid-answer."""
    if data.get("stream") is not True or data.get("n") not in (None, 1):
        return False
    if any(data.get(key) not in (None, False) for key in _NOT_RESUMABLE):
        return False
    return endpoint == CHAT or isinstance(data.get("prompt"), str)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a cut stream stands: the text it sent, its id and creation time, and whether its
    last choice chunk already ended the answer (then only the end of the stream was lost)."""

    text: str
    id: str
    created: int
    finished: bool = False

    def header(self) -> str:
        """The header value: JSON, ASCII only (header values are Latin-1)."""
        return json.dumps({"text": self.text, "id": self.id, "created": self.created})

    @classmethod
    def from_header(cls, value: str) -> ResumePoint:
        try:
            fields = json.loads(value)
            point = cls(text=fields["text"], id=fields["id"], created=fields["created"])
        except (ValueError, TypeError, KeyError):
            raise OpenAIError(400, "malformed resume point") from None
        if not (isinstance(point.text, str) and isinstance(point.id, str)):
            raise OpenAIError(400, "malformed resume point")
        if not isinstance(point.created, int) or isinstance(point.created, bool):
            raise OpenAIError(400, "malformed resume point")
        return point


def resume_point(sent: bytes, endpoint: str) -> ResumePoint | None:
    """Where the stream `sent` (the events the client received) stands, or None when it cannot
    be resumed: several choices, a delta that is not plain text, an error event, or no chunk."""
    text: list[str] = []
    stream_id, created, finished = None, None, False
    for event in sent.split(_EVENT_END):
        event = event.strip()
        if not event.startswith(_DATA) or event == SSE_DONE.strip().encode():
            continue
        try:
            chunk = json.loads(event[len(_DATA) :])
        except ValueError:
            return None
        if not isinstance(chunk, dict) or "error" in chunk:
            return None
        choices = chunk.get("choices") or []
        if len(choices) > 1 or any(c.get("index", 0) != 0 for c in choices):
            return None
        stream_id, created = chunk.get("id", stream_id), chunk.get("created", created)
        for choice in choices:
            piece = _text_of(choice, endpoint)
            if piece is None:
                return None
            text.append(piece)
            finished = finished or choice.get("finish_reason") is not None
    if not isinstance(stream_id, str) or not isinstance(created, int):
        return None
    return ResumePoint(text="".join(text), id=stream_id, created=created, finished=finished)


def _text_of(choice: dict[str, Any], endpoint: str) -> str | None:
    if endpoint != CHAT:
        text = choice.get("text")
        return text if isinstance(text, str) else None
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict) or not {k for k, v in delta.items() if v} <= _PLAIN_DELTA:
        return None
    content = delta.get("content") or ""
    return content if isinstance(content, str) else None


def continue_request(body: Any, endpoint: str, point: ResumePoint, prior_tokens: int) -> None:
    """Turn the validated request `body` into the rest of its answer from `point` on, where
    `prior_tokens` is the arm tokenizer's count of the text already sent."""
    if point.text:
        if endpoint == CHAT:
            body.messages = [*body.messages, {"role": "assistant", "content": point.text}]
            body.add_generation_prompt = False
            body.continue_final_message = True
        else:
            body.prompt = body.prompt + point.text
    for key in ("max_completion_tokens", "max_tokens"):
        limit = getattr(body, key, None)
        if limit is not None:
            setattr(body, key, max(1, limit - prior_tokens))


@dataclasses.dataclass
class ResumedStream:
    """Rewrites the events of a resumed stream so that they continue the first one: its id and
    creation time, no second role chunk, and usage that counts the tokens sent before the cut as
    generated (not as prompt)."""

    point: ResumePoint
    endpoint: str
    prior_tokens: int

    def rewrite(self, events: str) -> str:
        out = []
        for event in events.split("\n\n"):
            if not event.startswith("data: {"):
                out.append(event)
                continue
            chunk = json.loads(event[len("data: ") :])
            chunk["id"], chunk["created"] = self.point.id, self.point.created
            usage = chunk.get("usage")
            if isinstance(usage, dict) and self.prior_tokens:
                usage["prompt_tokens"] = max(0, usage.get("prompt_tokens", 0) - self.prior_tokens)
                usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.prior_tokens
            if self.endpoint == CHAT and _role_chunk(chunk):
                continue
            out.append(f"data: {json.dumps(chunk)}")
        return "\n\n".join(out)


def _role_chunk(chunk: dict[str, Any]) -> bool:
    """The chunk a chat stream opens with: the assistant's role and no text."""
    choices = chunk.get("choices") or []
    return bool(choices) and all(
        (c.get("delta") or {}).get("role")
        and not (c.get("delta") or {}).get("content")
        and c.get("finish_reason") is None
        for c in choices
    )
