"""The dispatch's contract with clients, checked on the fake-arm harness (test_dispatch.py): what
it refuses before any arm is asked, in the OpenAI error shape, and which of its own headers a
client can neither set nor see. The live tests keep one smoke test per feature
(tests/integration/test_errors.py, test_auth_live.py); what an arm's front refuses is checked
there, against the real engines."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specserve import headers
from specserve.router import view
from tests.unit.test_dispatch import ADMIN_KEY, MODEL, Client, run

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture
def client(tmp_path, monkeypatch):
    return Client(tmp_path, monkeypatch)


def error_of(answer: dict) -> dict:
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "status", "param", "contains"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        (b'{"model": "\xff\xfe"}', 400, None, "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, 400, None, "deeper than"),
        (b'{"model": ' + b"[" * 100 + b"]" * 100 + b"}", 400, None, "deeper than"),
        ({"messages": MSG}, 400, "model", "required"),
        ({"model": "gpt-4", "messages": MSG}, 404, "model", "does not exist"),
        ({"model": MODEL, "messages": MSG, "max_tokens": -5}, 400, "max_tokens", "positive"),
        ({"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens", "positive"),
        ({"model": MODEL, "messages": MSG, "max_tokens": 10**9}, 400, "max_tokens", "at most"),
        ({"model": MODEL, "messages": MSG, "n": 10**6}, 400, "n", ""),
    ],
)
def test_a_request_the_dispatch_refuses_never_reaches_an_arm(client, body, status, param, contains):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, _, answer = run(client.request(CHAT, chunks=[raw]))
    assert got == status, answer
    error = error_of(answer)
    assert contains.lower() in error["message"].lower()
    assert error["param"] == param
    assert client.arms.requests == []


def test_an_unknown_arm_named_by_an_admin_is_a_400_on_the_header(client):
    got, _, answer = run(
        client.request(
            CHAT,
            {"model": MODEL, "messages": MSG},
            key=ADMIN_KEY,
            extra={headers.ARM_OVERRIDE: "nope"},
        )
    )
    assert got == 400
    error = error_of(answer)
    assert error["param"] == headers.ARM_OVERRIDE and "unknown arm" in error["message"]
    assert client.arms.requests == []


def test_a_body_over_the_limit_is_a_413(client):
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_200_000}]}
    got, _, answer = run(client.request(CHAT, huge))
    assert got == 413 and "limit" in error_of(answer)["message"].lower()
    assert client.arms.requests == []


def test_the_routers_own_headers_are_neither_taken_from_a_client_nor_shown_to_it(client):
    forged = {
        headers.REQUEST_TIMEOUT_S: "0.001",
        headers.RESUME_FROM: "forged",
        headers.CAPTURE: "forged",
        headers.USAGE: "forged",
    }
    got, found, _ = run(client.request(extra=forged))
    assert got == 200
    passed = client.arms.requests[-1]["headers"]
    for name, value in forged.items():
        assert passed.get(name.encode()) != value.encode(), name
    assert headers.USAGE not in found  # the arm's usage header stays inside


@pytest.mark.parametrize("sampling", [{"logit_bias": {"50": 5}}, {"min_p": 0.1}])
def test_sampling_that_speculation_refuses_goes_to_an_arm_without_it(client, sampling):
    """vLLM's speculative decoding refuses logit_bias and min_p: such a request goes to an arm
    that does not speculate (`b`, even at weight 0), whatever the weights; others as before."""

    async def main():
        for _ in range(8):
            got, found, answer = await client.request(
                CHAT, {"model": MODEL, "messages": MSG, **sampling}, key=ADMIN_KEY
            )
            assert got == 200 and found[headers.ARM] == "b", answer
        got, found, _ = await client.request(
            CHAT, {"model": MODEL, "messages": MSG, "min_p": 0, "logit_bias": {}}, key=ADMIN_KEY
        )
        assert got == 200 and found[headers.ARM] == "a"  # neither samples differently: as ever

    run(main())
    assert [r["path"].split("/")[2] for r in client.arms.requests] == ["b"] * 8 + ["a"]


def test_sampling_that_speculation_refuses_with_no_such_arm_running_is_a_400_on_the_field(
    tmp_path, monkeypatch
):
    client = Client(tmp_path, monkeypatch)
    state = replace(view.read_serve_state(), routable=frozenset({"a"}))  # b is down
    monkeypatch.setattr(view, "read_serve_state", lambda previous=None: state)
    body = {"model": MODEL, "messages": MSG, "logit_bias": {"50": 5}}
    got, _, answer = run(client.request(CHAT, body))
    assert got == 400, answer
    error = error_of(answer)
    assert error["param"] == "logit_bias" and "speculative decoding" in error["message"]
    assert client.arms.requests == []
