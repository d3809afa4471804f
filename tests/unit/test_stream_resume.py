"""A stream whose arm replica dies mid-way goes on from where it stood (wire/resume.py): the
dispatch's side against an arm standing in for Ray Serve's routing (as in test_dispatch.py), and
the arm's side on vLLM's own request models."""

from __future__ import annotations

import asyncio
import json

import pytest

from specserve import headers
from specserve.wire.errors import OpenAIError
from specserve.wire.requests import CHAT, COMPLETIONS
from specserve.wire.resume import (
    ResumedStream,
    ResumePoint,
    continue_request,
    resumable,
    resume_point,
)
from specserve.wire.validation import validate_request
from tests.unit.test_dispatch import MODEL, PUBLIC_KEY, Client

WORDS = [f"w{i} " for i in range(8)]
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


def chunk(endpoint: str, piece: str | None, finish: str | None = None, role=False) -> bytes:
    choice: dict = {"index": 0, "finish_reason": finish}
    if endpoint == CHAT:
        choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": piece}
    else:
        choice["text"] = piece or ""
    return f"data: {json.dumps({'id': 'cmpl-1', 'created': 7, 'choices': [choice]})}\n\n".encode()


class StreamingArm:
    """Ray Serve's routing to an arm whose front streams WORDS, a chunk each; a replica dies
    (ends the call without ending the response) after `dies_after` words, `deaths` times. A
    resumed request streams the words after its resume point's text, as the arm's front does."""

    def __init__(self, endpoint: str, dies_after: int | None, deaths: int = 1) -> None:
        self.endpoint, self.dies_after, self.deaths = endpoint, dies_after, deaths
        self.requests: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        body = (await receive())["body"]
        found = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "headers": found, "body": json.loads(body)})
        resume = found.get(headers.RESUME_FROM)
        start = len(ResumePoint.from_header(resume).text.split()) if resume else 0
        response_headers = [(b"content-type", b"text/event-stream"), (headers.ARM.encode(), b"a")]
        await send({"type": "http.response.start", "status": 200, "headers": response_headers})

        async def event(data: bytes, more=True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        if self.endpoint == CHAT and not resume:
            await event(chunk(CHAT, None, role=True))
        for i, word in enumerate(WORDS[start:], start):
            if self.deaths and i == self.dies_after:
                self.deaths -= 1
                return
            await event(chunk(self.endpoint, word))
        await event(chunk(self.endpoint, "", finish="stop"))
        if self.deaths and self.dies_after == len(WORDS):  # dies after the answer's last chunk
            self.deaths -= 1
            return
        usage = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": len(WORDS)}}
        await event(f"data: {json.dumps(usage)}\n\n".encode())
        await event(b"data: [DONE]\n\n", more=False)


async def stream(client: Client, body: dict, extra: dict[str, str] | None = None):
    """The status and the events a streaming client receives."""
    raw = json.dumps(body).encode()
    request_headers = [(b"authorization", f"Bearer {PUBLIC_KEY}".encode())]
    request_headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    scope = {"type": "http", "method": "POST", "headers": request_headers}
    scope["path"] = PATHS[CHAT if "messages" in body else COMPLETIONS]
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    await client.dispatch(scope, receive, send)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, starts  # one response, however many replicas served it
    assert not sent[-1].get("more_body")  # the response ends
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return starts[0]["status"], [e for e in data.decode().split("\n\n") if e]


def text_of(events: list[str], endpoint: str) -> str:
    point = resume_point("\n\n".join(events).encode() + b"\n\n", endpoint)
    assert point is not None, events
    return point.text


def body_for(endpoint: str, **more) -> dict:
    if endpoint == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **more}
    return {"model": MODEL, "prompt": "hi", **more}


@pytest.fixture
def client(tmp_path, monkeypatch):
    return Client(tmp_path, monkeypatch)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_stream_cut_mid_way_is_resumed_from_where_it_stood(client, endpoint):
    arm = client.dispatch.arms = StreamingArm(endpoint, dies_after=3)
    client.arms = arm

    async def main():
        forged = {headers.RESUME_FROM: ResumePoint("w0 w1 w2 w3 ", "x", 1).header()}
        status, events = await stream(client, body_for(endpoint, stream=True), forged)
        assert status == 200
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        assert text_of(events, endpoint) == "".join(WORDS)  # every word once, in order
        first, second = arm.requests
        assert headers.RESUME_FROM not in first["headers"]  # a client's own is dropped
        point = ResumePoint.from_header(second["headers"][headers.RESUME_FROM])
        assert point == ResumePoint(text="".join(WORDS[:3]), id="cmpl-1", created=7)
        assert first["body"] == second["body"]
        assert sum(client.dispatch.state.at_arm.values()) == 0

    asyncio.run(main())


def test_a_stream_is_resumed_once_and_then_ends_with_an_error_event(client):
    arm = client.dispatch.arms = StreamingArm(COMPLETIONS, dies_after=3, deaths=3)

    async def main():
        status, events = await stream(client, body_for(COMPLETIONS, stream=True))
        assert status == 200 and len(arm.requests) == 2  # resumed once, cut again
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        assert "".join(WORDS[:3]) == text_of(events[:-2], COMPLETIONS)  # nothing sent twice
        status, events = await stream(client, body_for(COMPLETIONS, stream=True))
        assert len(arm.requests) == 3  # the same body is not replayed again
        assert '"error"' in events[-2]

    asyncio.run(main())


@pytest.mark.parametrize(
    "more",
    [
        {"n": 2},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
    ],
)
def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event(client, more):
    arm = client.dispatch.arms = StreamingArm(CHAT, dies_after=3)

    async def main():
        status, events = await stream(client, body_for(CHAT, stream=True, **more))
        assert status == 200 and len(arm.requests) == 1
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"

    asyncio.run(main())


def test_a_stream_cut_after_its_answer_ended_only_gets_its_end(client):
    arm = client.dispatch.arms = StreamingArm(CHAT, dies_after=len(WORDS))

    async def main():
        status, events = await stream(client, body_for(CHAT, stream=True))
        assert status == 200 and len(arm.requests) == 1  # nothing was left to generate
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        assert text_of(events, CHAT) == "".join(WORDS)

    asyncio.run(main())


# -- what both sides speak ---------------------------------------------------------------------


def test_which_requests_are_resumable():
    assert resumable(body_for(CHAT, stream=True), CHAT)
    assert resumable(body_for(COMPLETIONS, stream=True, n=1), COMPLETIONS)
    assert not resumable(body_for(CHAT), CHAT)  # not a stream: retried before its first byte
    assert not resumable({**body_for(COMPLETIONS, stream=True), "prompt": ["a", "b"]}, COMPLETIONS)
    assert not resumable(body_for(COMPLETIONS, stream=True, echo=True), COMPLETIONS)
    assert not resumable(body_for(CHAT, stream=True, structured_outputs={"regex": "a+"}), CHAT)


def test_a_resume_point_reads_plain_text_and_nothing_else():
    role = chunk(CHAT, None, role=True)
    sent = role + chunk(CHAT, "Hel") + chunk(CHAT, "lo")
    assert resume_point(sent, CHAT) == ResumePoint("Hello", "cmpl-1", 7)
    finished = resume_point(sent + chunk(CHAT, "", finish="stop"), CHAT)
    assert finished is not None and finished.finished
    tool = b'data: {"id":"c","created":1,"choices":[{"index":0,"delta":{"tool_calls":[{}]}}]}\n\n'
    assert resume_point(sent + tool, CHAT) is None
    two = b'data: {"id":"c","created":1,"choices":[{"index":1,"text":"x"}]}\n\n'
    assert resume_point(chunk(COMPLETIONS, "a") + two, COMPLETIONS) is None
    error = b'data: {"error": {"message": "x"}}\n\n'
    assert resume_point(chunk(COMPLETIONS, "a") + error, COMPLETIONS) is None
    assert resume_point(b"", COMPLETIONS) is None  # no chunk: no id to go on with


@pytest.mark.parametrize("value", ["", "[]", '{"text": 1, "id": "a", "created": 1}', "{"])
def test_a_malformed_resume_point_is_refused(value):
    with pytest.raises(OpenAIError) as refused:
        ResumePoint.from_header(value)
    assert refused.value.status == 400
    point = ResumePoint("naïve “quotes”\n", "id", 3)
    assert ResumePoint.from_header(point.header()) == point
    assert point.header().isascii()  # a header value


def test_the_arm_continues_a_chat_from_its_text_with_fewer_tokens():
    body = validate_request(body_for(CHAT, stream=True, max_tokens=20), CHAT)
    body.messages = body_for(CHAT)["messages"]
    continue_request(body, CHAT, ResumePoint("The sea is", "id", 1), prior_tokens=3)
    assert body.messages[-1] == {"role": "assistant", "content": "The sea is"}
    assert body.continue_final_message and not body.add_generation_prompt
    assert body.max_tokens == 17


def test_the_arm_continues_a_completion_from_its_text_with_fewer_tokens():
    body = validate_request(body_for(COMPLETIONS, stream=True, max_tokens=5), COMPLETIONS)
    continue_request(body, COMPLETIONS, ResumePoint(" there", "id", 1), prior_tokens=9)
    assert body.prompt == "hi there"
    assert body.max_tokens == 1  # never zero: vLLM refuses that


def test_a_resumed_stream_continues_the_first_ones_id_role_and_usage():
    rewrite = ResumedStream(ResumePoint("abc", "first", 5), CHAT, prior_tokens=3).rewrite
    role = chunk(CHAT, None, role=True).decode()
    assert rewrite(role) == ""  # the client has the first stream's role chunk
    rewritten = json.loads(rewrite(chunk(CHAT, "d").decode())[len("data: ") :])
    assert (rewritten["id"], rewritten["created"]) == ("first", 5)
    assert rewritten["choices"][0]["delta"]["content"] == "d"
    usage = 'data: {"id":"x","created":9,"choices":[],"usage":{"prompt_tokens":13,'
    usage += '"completion_tokens":4,"total_tokens":17}}\n\n'
    counted = json.loads(rewrite(usage)[len("data: ") :])["usage"]
    assert counted == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    assert rewrite("data: [DONE]\n\n") == "data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [True, 1, "true", "yes"])
def test_every_stream_asks_for_the_usage_chunk_however_it_is_spelled(stream):
    data = body_for(COMPLETIONS, max_tokens=5)
    body = validate_request({**data, "stream": stream}, COMPLETIONS)
    assert body.stream is True and body.stream_options.include_usage is True
    kept = validate_request({**data, "stream": 0}, COMPLETIONS)
    assert not kept.stream and kept.stream_options is None


def test_the_salt_a_key_is_given_is_one_the_engine_takes():
    from specserve.wire.requests import salt_for_key

    data = body_for(COMPLETIONS, max_tokens=5)
    salt_for_key(data, "team-a")
    assert validate_request(data, COMPLETIONS).cache_salt == data["cache_salt"]
