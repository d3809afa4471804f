"""The dispatch's request path (router/dispatch.py) against a fake arm: an ASGI app standing in
for Ray Serve's proxy routing, which answers as an arm's front does. What the arm states are
is given, not read from a Ray Serve controller; everything else is the real dispatch: API keys,
the admin override, the headers passed on, limits, replays, the guardrail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import headers
from specserve.capture.store import Bounds, Sampled
from specserve.metrics import RouterMetrics
from specserve.router import dispatch as dispatch_module
from specserve.router import view
from specserve.router.arm_states import ServeState
from specserve.router.dispatch import Dispatch
from specserve.router.selection import load_salt, sticky_arm
from specserve.wire.requests import prompt_digest

MODEL = "m"
PUBLIC_KEY = "public-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
CONFIG = """\
model: {{name: m, source: /nowhere, accelerator: cpu}}
routing: {{arm_header: {arm_header}, replay_on_another_arm: {replay_on_another_arm}{routing}}}
limits: {{max_tokens: 64, max_total_tokens: 128, body_timeout_s: 0.5{per_key}}}
guardrail: {{min_acceptance_length: 1.5, window_s: 60, min_drafts: 20, drain_s: 300}}
arms:
  - {{name: a, weight: 1, speculative: {{method: ngram, num_speculative_tokens: 3}}{capture}}}
  - {{name: b, weight: {weight_b}}}
"""


class FakeArms:
    """Ray Serve's routing to the arms: answers as an arm's front, and records what it got."""

    def __init__(self) -> None:
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.dead: set[str] = set()  # arms whose replica dies before answering
        self.held: set[str] = set()  # arms with no live replica: Ray Serve holds the request
        # Requests an arm's replica holds when it dies (it dies once all have arrived); the
        # replica that replaces it answers.
        self.die_with: dict[str, int] = {}
        self._dying: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append(
            {"path": scope["path"], "headers": dict(scope["headers"]), "body": body}
        )
        arm = scope["path"].split("/")[2]
        if arm in self.dead:
            return
        if self.die_with.get(arm):
            self.die_with[arm] -= 1
            dies = self._dying.setdefault(arm, asyncio.Event())
            if not self.die_with[arm]:
                dies.set()
            await dies.wait()
            return
        if arm in self.held:
            await asyncio.sleep(3600)
        usage = {
            "usage": {"completion_tokens": 5},
            # Every draft rejected: below the guardrail's floor.
            "metrics": {"speculative_decoding": {"num_spec_steps": 10, "num_draft_tokens": 30}},
        }
        answer = json.dumps({"choices": [{"text": "x"}]}).encode()
        response_headers = [
            (b"content-type", b"application/json"),
            (headers.ARM.encode(), arm.encode()),
            (headers.USAGE.encode(), json.dumps(usage).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": response_headers})
        await send({"type": "http.response.body", "body": answer, "more_body": False})


class Client:
    """One dispatch (as in one proxy) over the fake arms, driven as ASGI."""

    def __init__(
        self,
        tmp_path: Path,
        monkeypatch,
        *,
        exposed=frozenset(),
        per_key="",
        weight_b=0,
        capture="",
        arm_header="admin",
        sticky_salt: str | None = None,
        replay_on_another_arm: bool = False,
        routing: str = "",
    ) -> None:
        self.config = tmp_path / "config.yaml"
        self.config.write_text(
            CONFIG.format(
                per_key=per_key,
                weight_b=weight_b,
                capture=capture,
                arm_header=arm_header,
                replay_on_another_arm=str(replay_on_another_arm).lower(),
                routing=routing,
            )
        )
        self.api_keys = tmp_path / "api-keys"
        self.api_keys.write_text(f"# public keys\nteam-a={PUBLIC_KEY}\n")
        self.admin_keys = tmp_path / "admin-keys"
        self.admin_keys.write_text(f"ops={ADMIN_KEY}\n")
        args = {
            "config_path": str(self.config),
            "config_poll_s": 0.05,
            "api_keys_file": str(self.api_keys),
            "admin_keys_file": str(self.admin_keys),
        }
        if sticky_salt is not None:
            (tmp_path / "sticky-salt").write_text(sticky_salt)
            args["sticky_salt_file"] = str(tmp_path / "sticky-salt")
        state = ServeState(
            statuses={"a": "RUNNING", "b": "RUNNING"},
            routable=frozenset({"a", "b"}),
            router_args=args,
            exposed=frozenset(exposed),
        )
        monkeypatch.setattr(view, "read_serve_state", lambda previous=None: state)
        # vLLM's argument parser takes ~20 s to import; the engine settings are not under test.
        monkeypatch.setattr(view, "check_engine_settings", lambda *a, **k: None)
        monkeypatch.setattr("specserve.watch.check_engine_settings", lambda *a, **k: None)
        self.arms = FakeArms()
        self.dispatch = Dispatch(self.arms, arms=self.arms)

    async def request(
        self,
        path="/v1/completions",
        body: dict | None = None,
        key: str | None = PUBLIC_KEY,
        extra: dict[str, str] | None = None,
        chunks: list[bytes] | None = None,
        pause_s: float = 0.0,
        method: str = "POST",
    ) -> tuple[int, dict[str, str], dict]:
        raw = json.dumps(body if body is not None else {"model": MODEL, "prompt": "hi"}).encode()
        parts = chunks if chunks is not None else [raw]
        request_headers = [(b"content-type", b"application/json")]
        if key is not None:
            request_headers.append((b"authorization", f"Bearer {key}".encode()))
        for name, value in (extra or {}).items():
            request_headers.append((name.encode(), value.encode()))
        scope = {"type": "http", "method": method, "path": path, "headers": request_headers}
        pending = list(parts)
        sent: list[dict] = []

        async def receive():
            if pending:
                part = pending.pop(0)
                if pause_s and not pending:
                    await asyncio.sleep(pause_s)
                return {"type": "http.request", "body": part, "more_body": bool(pending)}
            await asyncio.sleep(3600)  # the client stays connected

        async def send(message):
            sent.append(message)

        await self.dispatch(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        found = {k.decode(): v.decode() for k, v in start["headers"]}
        return start["status"], found, json.loads(answer) if answer else {}


@pytest.fixture
def client(tmp_path, monkeypatch):
    return Client(tmp_path, monkeypatch)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_missing_or_wrong_key_gets_401_in_the_openai_shape(client):
    async def main():
        for key, code in ((None, "missing_api_key"), ("wrong-key-0123456789", "invalid_api_key")):
            status, found, body = await client.request(key=key)
            assert status == 401
            assert found["www-authenticate"].startswith("Bearer")
            assert body["error"]["code"] == code and body["error"]["type"]
            assert "wrong-key" not in json.dumps(body)  # a key is never echoed
        assert client.arms.requests == []
        status, _, _ = await client.request(key=PUBLIC_KEY)
        assert status == 200
        status, _, _ = await client.request(key=ADMIN_KEY)  # an admin key is an API key too
        assert status == 200

    run(main())


def test_the_key_does_not_reach_the_arm_nor_do_headers_that_steer_ray_serve(client):
    steering = {
        "x-request-disconnect-disabled": "?1",
        "x-request-timeout-seconds": "0.001",
        "serve_multiplexed_model_id": "other",
        "Serve-Multiplexed-Model-Id": "other",
        headers.REQUEST_TIMEOUT_S: "0.001",
    }

    async def main():
        status, _, _ = await client.request(extra=steering)
        assert status == 200
        passed = client.arms.requests[-1]["headers"]
        names = {name.decode().lower() for name in passed}
        assert "authorization" not in names
        assert not names & {n.lower() for n in steering} - {headers.REQUEST_TIMEOUT_S}
        assert passed[headers.REQUEST_TIMEOUT_S.encode()] != b"0.001"  # the config's limit

    run(main())


def test_a_client_request_id_is_kept_only_in_the_expected_shape(client):
    async def main():
        _, found, _ = await client.request(extra={headers.REQUEST_ID: "abc-123:x.y_z"})
        assert found[headers.REQUEST_ID] == "abc-123:x.y_z"  # on the arm's answer
        assert client.arms.requests[-1]["headers"][b"x-request-id"] == b"abc-123:x.y_z"
        for bad in ("a b", "x" * 129, "<script>", "line\\nbreak"):
            _, found, _ = await client.request(extra={headers.REQUEST_ID: bad})
            given = client.arms.requests[-1]["headers"][b"x-request-id"].decode()
            assert given != bad and len(given) == 36  # a new uuid
            assert found[headers.REQUEST_ID] == given  # the client learns it

    run(main())


def test_forcing_an_arm_needs_an_admin_key(client):
    async def main():
        status, _, body = await client.request(extra={headers.ARM_OVERRIDE: "b"})
        assert status == 403 and body["error"]["code"] == "admin_key_required"
        status, found, _ = await client.request(key=ADMIN_KEY, extra={headers.ARM_OVERRIDE: "b"})
        assert status == 200 and found[headers.ARM] == "b"

    run(main())


def test_forced_requests_neither_drain_an_arm_nor_count_in_the_ab_statistics(client):
    """Every answer of the fake arm accepts no draft, below the guardrail's floor: forced
    requests leave the arm in the split; weighted ones drain it."""

    async def main():
        force = {headers.ARM_OVERRIDE: "a"}
        for _ in range(5):  # 50 verify steps, past the 20 the guardrail needs
            assert (await client.request(key=ADMIN_KEY, extra=force))[0] == 200
        state = client.dispatch.state
        assert state.guard.drained() == frozenset()
        for _ in range(5):
            assert (await client.request())[0] == 200
        assert state.guard.drained() == {"a"}

    run(main())


def test_one_key_past_its_share_of_an_arms_statistics_is_served_but_cannot_drain_it(
    tmp_path, monkeypatch
):
    """routing.max_key_share 0.1 of 10 counted requests: one request per key. Every answer
    (10 verify steps, no draft accepted) is below the floor, and the guardrail needs 20 steps:
    one key alone, however many requests it sends, stays at 10; a second key's request makes
    20 and drains the arm. (Without the bound the first key alone drains it: the test above.)"""
    other_key = "other-key-0123456789abcdef"
    client = Client(tmp_path, monkeypatch, routing=", max_key_share: 0.1, key_share_window: 10")
    client.api_keys.write_text(f"team-a={PUBLIC_KEY}\nteam-b={other_key}\n")

    async def main():
        for _ in range(6):
            assert (await client.request())[0] == 200  # served, counted once
        state = client.dispatch.state
        assert state.guard.drained() == frozenset()
        assert (await client.request(key=other_key))[0] == 200
        assert state.guard.drained() == {"a"}

    run(main())


def test_a_request_without_max_tokens_gets_the_limit_and_n_times_tokens_is_bounded(client):
    async def main():
        status, _, _ = await client.request(body={"model": MODEL, "prompt": "hi", "n": 4})
        assert status == 200
        sent = json.loads(client.arms.requests[-1]["body"])
        assert sent["max_tokens"] == 32  # max_total_tokens 128 / n 4, within max_tokens 64
        status, _, _ = await client.request(body={"model": MODEL, "prompt": "hi"})
        assert json.loads(client.arms.requests[-1]["body"])["max_tokens"] == 64
        many = {"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 64}
        status, _, body = await client.request(body=many)
        assert status == 400 and "n x max_tokens is 3 x 64" in body["error"]["message"]

    run(main())


def test_every_prompt_of_a_completion_counts_against_the_token_cap(client):
    async def main():
        four = {"model": MODEL, "prompt": ["a", "b", "c", "d"]}
        assert (await client.request(body=four))[0] == 200
        assert json.loads(client.arms.requests[-1]["body"])["max_tokens"] == 32  # 128 / 4
        status, _, body = await client.request(body={**four, "max_tokens": 64})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        assert "prompts x n x max_tokens is 4 x 1 x 64 = 256" in body["error"]["message"]
        token_lists = {"model": MODEL, "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 64}
        assert (await client.request(body=token_lists))[0] == 400
        one_token_list = {"model": MODEL, "prompt": [1, 2, 3], "n": 2, "max_tokens": 64}
        assert (await client.request(body=one_token_list))[0] == 200  # one prompt of ids

    run(main())


def test_the_cap_counts_the_token_field_the_engine_honours(client):
    async def main():
        # A completion knows only max_tokens: max_completion_tokens would hide 3 x 64 behind 3.
        hidden = {"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 64}
        status, _, body = await client.request(body={**hidden, "max_completion_tokens": 1})
        assert status == 400 and "n x max_tokens is 3 x 64" in body["error"]["message"]
        # A chat takes max_completion_tokens over max_tokens.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}
        path = "/v1/chat/completions"
        wide = {**chat, "max_completion_tokens": 64, "max_tokens": 1}
        status, _, body = await client.request(path=path, body=wide)
        assert status == 400 and body["error"]["param"] == "max_completion_tokens"
        narrow = {**chat, "max_completion_tokens": 1, "max_tokens": 64}
        assert (await client.request(path=path, body=narrow))[0] == 200

    run(main())


@pytest.mark.parametrize("stream", [1, "true", "on"])
def test_a_stream_spelled_otherwise_reaches_the_arm_as_true(client, stream):
    async def main():
        assert (await client.request(body={"model": MODEL, "prompt": "hi", "stream": stream}))[
            0
        ] == 200
        assert json.loads(client.arms.requests[-1]["body"])["stream"] is True

    run(main())


def test_a_body_slower_than_the_deadline_gets_408(client):
    raw = json.dumps({"model": MODEL, "prompt": "hi"}).encode()

    async def main():
        status, _, body = await client.request(chunks=[raw[:5], raw[5:]], pause_s=2.0)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert client.arms.requests == []

    run(main())


def test_a_request_whose_replica_died_is_replayed_once_and_never_again(client):
    async def main():
        client.arms.dead = {"a", "b"}
        status, _, body = await client.request()
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        assert len(client.arms.requests) == 2  # the request and its one replay
        status, _, _ = await client.request()  # the same body again: no second replay
        assert status == 503 and len(client.arms.requests) == 3
        other = {"model": MODEL, "prompt": "other"}
        status, _, _ = await client.request(body=other)
        assert status == 503 and len(client.arms.requests) == 4  # this key's budget is spent
        status, _, _ = await client.request(body=other, key=ADMIN_KEY)
        assert len(client.arms.requests) == 6  # another key's body is replayed once

    run(main())


def test_identical_requests_cut_by_one_replica_death_are_all_replayed(client):
    """Users send identical bodies; one engine's death cuts them together: each is replayed
    (the first replay's answer shows the body harmless), none is refused for another's sake."""

    async def main():
        client.arms.die_with = {"a": 3}
        answers = await asyncio.gather(*(client.request() for _ in range(3)))
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert len(client.arms.requests) == 6  # three cut, three replayed
        assert sum(client.dispatch.state.at_arm.values()) == 0

    run(main())


def test_a_sampled_request_reaches_its_arm_with_the_capture_bounds_unless_opted_out(
    tmp_path, monkeypatch
):
    client = Client(
        tmp_path,
        monkeypatch,
        capture=", capture: {sample: 1.0, max_records: 50, max_age_s: 60}",
        per_key=", per_key: {ops: {capture: false}}",  # the admin key's name
    )
    capture, no_capture = headers.CAPTURE.encode(), headers.NO_CAPTURE.encode()

    def sent() -> dict[bytes, bytes]:
        return client.arms.requests[-1]["headers"]

    async def main():
        assert (await client.request(extra={headers.CAPTURE: "forged"}))[0] == 200
        # The bounds, and the name of the key that sent it (team-a: PUBLIC_KEY's).
        # The bounds, the key's name and the prompt's digest (what the loop leaves out by).
        asked = prompt_digest({"model": MODEL, "prompt": "hi"}, "completions")
        expected = Sampled(Bounds(50, 60.0), "team-a", asked)
        assert Sampled.from_header(sent()[capture].decode()) == expected
        await client.request(extra={headers.NO_CAPTURE: "1"})  # the client opts out
        assert capture not in sent() and no_capture not in sent()
        await client.request(key=ADMIN_KEY)  # its key opted out
        assert capture not in sent()
        await client.request(key=ADMIN_KEY, extra={headers.ARM_OVERRIDE: "b"})  # no capture
        assert capture not in sent()

    run(main())


def test_a_prompt_the_config_leaves_out_is_served_but_kept_out_of_the_ab_statistics(
    tmp_path, monkeypatch
):
    """routing.ab_left_out_prompts (what a challenger was trained on): such a request is
    answered, counted apart and not in the A/B figures; its repeats with other numbers, case or
    spacing too; any other prompt is in them."""
    listed = prompt_digest({"messages": [{"role": "user", "content": "Order 12, Bob"}]}, "chat")
    client = Client(tmp_path, monkeypatch, routing=f", ab_left_out_prompts: ['{listed}']")
    in_ab: list[bool] = []
    left_out: list[str] = []
    monkeypatch.setattr(
        RouterMetrics,
        "observe_request",
        lambda self, arm, **figures: in_ab.append(figures["randomized"]),
    )
    monkeypatch.setattr(RouterMetrics, "count_left_out", lambda self, arm: left_out.append(arm))

    def chat(text: str) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}]}

    async def main():
        for text in ("order  97,  BOB", "Order 12, Alice"):
            assert (await client.request("/v1/chat/completions", chat(text)))[0] == 200

    run(main())
    assert in_ab == [False, True] and left_out == ["a"]


def test_capture_samples_requests_at_the_configured_rate(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch, capture=", capture: {sample: 0.25}")

    async def main():
        for _ in range(400):
            await client.request()
        captured = sum(headers.CAPTURE.encode() in r["headers"] for r in client.arms.requests)
        assert 60 <= captured <= 140  # 100 expected; 4.6 standard deviations either side

    run(main())


def test_keys_are_read_again_when_the_file_changes(client):
    new_key = "rotated-key-0123456789abcdef"

    async def main():
        assert (await client.request())[0] == 200
        client.api_keys.write_text(f"team-a={new_key}\n")
        for _ in range(100):
            await asyncio.sleep(0.05)
            if (await client.request(key=new_key))[0] == 200:
                break
        assert (await client.request(key=new_key))[0] == 200
        assert (await client.request(key=PUBLIC_KEY))[0] == 401  # revoked
        # Refused (a bad line): the keys it still holds stay, those it dropped are revoked.
        client.api_keys.write_text(f"team-a={new_key}\nteam-b=short\n")
        await asyncio.sleep(0.3)
        assert (await client.request(key=new_key))[0] == 200
        client.api_keys.write_text("team-a=short\n")
        await asyncio.sleep(0.3)
        assert (await client.request(key=new_key))[0] == 401

    run(main())


def test_a_key_over_its_request_rate_gets_429_with_retry_after(tmp_path, monkeypatch):
    limited = Client(tmp_path, monkeypatch, per_key=", per_key: {team-a: {requests_per_minute: 2}}")

    async def main():
        assert [(await limited.request())[0] for _ in range(2)] == [200, 200]
        status, found, body = await limited.request()
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        assert int(found[headers.RETRY_AFTER]) >= 1
        assert (await limited.request(key=ADMIN_KEY))[0] == 200  # another key, another bucket

    run(main())


def test_a_key_reserves_its_most_tokens_and_a_client_that_leaves_keeps_them(tmp_path, monkeypatch):
    limited = Client(
        tmp_path, monkeypatch, per_key=", per_key: {team-a: {output_tokens_per_minute: 100}}"
    )

    def asking(tokens: int) -> dict:
        return {"model": MODEL, "prompt": "hi", "max_tokens": tokens}

    async def main():
        # Answered with 5 tokens: the rest of the 60 reserved comes back.
        assert (await limited.request(body=asking(60)))[0] == 200
        assert (await limited.request(body=asking(60)))[0] == 200
        limited.arms.held = {"a"}
        held = asyncio.ensure_future(limited.request(body=asking(60)))
        await asyncio.sleep(0.2)
        # Two at once may not both take 60 of a bucket of ~90.
        status, _, body = await limited.request(body=asking(60))
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        held.cancel()  # the client leaves: its 60 stay spent
        with pytest.raises(asyncio.CancelledError):
            await held
        limited.arms.held = set()
        assert (await limited.request(body=asking(40)))[0] == 429
        assert (await limited.request(body=asking(20)))[0] == 200

    run(main())


def test_an_arms_own_routes_only_for_exposed_arms_with_an_admin_key(tmp_path, monkeypatch):
    async def main(client, expected):
        got = []
        for key in (PUBLIC_KEY, ADMIN_KEY):
            status, _, _ = await client.request(path="/arms/a/v1/completions", key=key)
            got.append(status)
        assert got == expected

    run(main(Client(tmp_path, monkeypatch), [404, 404]))
    run(main(Client(tmp_path, monkeypatch, exposed={"a"}), [403, 200]))


def test_an_arms_own_routes_are_closed_while_the_arm_states_are_unknown(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch, exposed={"a"})
    # No Serve controller answers: no router application is known.
    monkeypatch.setattr(view, "read_serve_state", lambda previous=None: ServeState())
    monkeypatch.setattr(view, "FIRST_READ_WAIT_S", 0.1)

    async def main():
        status, _, _ = await client.request(path="/arms/a/v1/completions", key=ADMIN_KEY)
        assert status == 404 and client.arms.requests == []

    run(main())


def test_a_node_being_drained_refuses_new_requests_and_says_it_is_not_ready(client, monkeypatch):
    async def main():
        status, _, _ = await client.request()
        assert status == 200
        # `specserve drain-node` marked this proxy's node (the pod's preStop).
        drained = dataclasses.replace(client.dispatch.state.serve_state, node_draining=True)
        monkeypatch.setattr(view, "read_serve_state", lambda previous=None: drained)
        client.dispatch.state.serve_state = drained
        status, found, body = await client.request()
        assert status == 503 and body["error"]["code"] == "shutting_down"
        assert found[headers.RETRY_AFTER.lower()] == "1"
        assert len(client.arms.requests) == 1  # only the first reached an arm
        status, _, ready = await client.request(path="/ready", key=None, method="GET")
        assert status == 503 and ready["draining"] is True

    run(main())


def test_models_needs_a_key_too_and_probes_do_not(client):
    async def main():
        for path, key, expected in (
            ("/v1/models", None, 401),
            ("/v1/models", PUBLIC_KEY, 200),
            ("/health", None, 200),
        ):
            assert await _get(client, path, key) == expected, (path, key)

    run(main())


async def _get(client: Client, path: str, key: str | None) -> int:
    request_headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    scope = {"type": "http", "method": "GET", "path": path, "headers": request_headers}
    sent = []

    async def passthrough(scope, receive, send):  # the router application
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    client.dispatch.app = passthrough
    await client.dispatch(scope, receive, send)
    return sent[0]["status"]


def test_a_weighted_request_whose_arm_failed_is_replayed_on_another_arm(tmp_path, monkeypatch):
    # The public key, told its arm: the admin key's replays are spent on the forced request.
    client = Client(
        tmp_path, monkeypatch, weight_b=1, arm_header="everyone", replay_on_another_arm=True
    )

    async def main():
        client.arms.dead = {"a"}
        forced = {headers.ARM_OVERRIDE: "a"}
        status, _, _ = await client.request(key=ADMIN_KEY, extra=forced)
        assert status == 503  # forced to its arm: replayed there once, and failed again
        assert [r["path"].split("/")[2] for r in client.arms.requests] == ["a", "a"]
        client.arms.requests.clear()
        for i in range(8):
            body = {"model": MODEL, "prompt": f"hi {i}"}
            status, found, _ = await client.request(body=body)
            assert status == 200 and found[headers.ARM] == "b"
        assert {r["path"].split("/")[2] for r in client.arms.requests} == {"a", "b"}
        assert sum(client.dispatch.state.at_arm.values()) == 0  # every count given back

    run(main())


def test_a_request_held_for_an_arm_that_stopped_running_is_taken_back(tmp_path, monkeypatch):
    """Ray Serve holds a request for an arm whose only replica died until a new one runs
    (minutes for an engine); once the arm is seen stopped, the request goes to another arm
    (routing.replay_on_another_arm)."""
    from specserve.router.selection import choose_arm

    client = Client(tmp_path, monkeypatch, weight_b=1, replay_on_another_arm=True)
    both = frozenset({"a", "b"})
    session = next(  # a session the weights place on arm a
        f"s{i}"
        for i in range(100)
        if choose_arm({"a": 1, "b": 1}, routable=both, drained=set(), sticky_key=f"s{i}").arm == "a"
    )
    client.arms.held = {"a"}

    async def main():
        asking = asyncio.ensure_future(
            client.request(key=ADMIN_KEY, extra={"x-session-id": session})
        )
        await asyncio.sleep(1.5)
        assert not asking.done()  # held
        stopped = dataclasses.replace(
            client.dispatch.state.serve_state,
            statuses={"a": "DEPLOYING", "b": "RUNNING"},
            routable=frozenset({"b"}),
        )
        monkeypatch.setattr(view, "read_serve_state", lambda previous=None: stopped)
        status, found, _ = await asyncio.wait_for(asking, 5)
        assert status == 200 and found[headers.ARM] == "b"
        assert [r["path"].split("/")[2] for r in client.arms.requests] == ["a", "b"]
        assert sum(client.dispatch.state.at_arm.values()) == 0

    run(main())


def test_a_controller_read_that_hangs_times_out_and_its_age_shows(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch)
    first = view.read_serve_state(None)
    calls = []
    release = threading.Event()

    def hanging(previous=None):
        calls.append(1)
        if len(calls) > 1:
            release.wait(2)  # the controller does not answer (beyond the test)
        return first

    monkeypatch.setattr(view, "read_serve_state", hanging)
    monkeypatch.setattr(view, "READ_TIMEOUT_S", 0.1)
    monkeypatch.setattr(view, "POLL_S", 0.05)

    async def main():
        assert (await client.request())[0] == 200
        await asyncio.sleep(1.0)
        assert (await client.request())[0] == 200  # routed with the last arm states
        return client.dispatch.state.metrics._arm_states_age_s, len(calls)

    try:
        age_s, reads = run(main())
    finally:
        release.set()
    assert age_s > 0.5
    assert reads == 2  # the hanging read is waited on again, never started twice


def test_a_large_body_is_parsed_off_the_event_loop(client, monkeypatch):
    parsed_in = []
    real_parse = dispatch_module.parse_body

    def parse(raw):
        parsed_in.append(threading.current_thread() is threading.main_thread())
        return real_parse(raw)

    monkeypatch.setattr(dispatch_module, "parse_body", parse)
    big = {"model": MODEL, "prompt": "x" * (dispatch_module.PARSE_OFF_LOOP_BYTES + 1)}

    async def main():
        assert (await client.request())[0] == 200
        assert (await client.request(body=big))[0] == 200

    run(main())
    assert parsed_in == [True, False]  # the small body on the loop, the large one in a thread


def test_a_client_that_leaves_mid_answer_frees_the_arms_capacity_at_once(client):
    """The arm call (wire/arm_calls.py) notices the disconnect and ends; the dispatch gives
    the request's place at the arm back as that call returns."""

    async def streaming_arm(scope, receive, send):
        await receive()  # the body, replayed by the dispatch
        start = {"type": "http.response.start", "status": 200}
        start["headers"] = [
            (b"content-type", b"text/event-stream"),
            (headers.ARM.encode(), b"a"),
        ]
        await send(start)
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass

    client.dispatch.arms = streaming_arm
    raw = json.dumps({"model": MODEL, "prompt": "hi", "stream": True}).encode()
    request_headers = [(b"authorization", f"Bearer {PUBLIC_KEY}".encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
    scope["headers"] = request_headers
    left = asyncio.Event()
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])

    async def receive():
        message = next(messages, None)
        if message is not None:
            return message
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    async def main():
        serving = asyncio.create_task(client.dispatch(scope, receive, send))
        await asyncio.sleep(0.2)
        state = client.dispatch.state
        assert state.at_arm["a"] == 1
        left.set()
        await asyncio.wait_for(serving, 1)
        assert state.at_arm["a"] == 0

    run(main())


USAGE_CHUNKS = [
    # As the arm's front writes it (pydantic's compact JSON).
    b'data: {"id":"c","choices":[],"usage":{"completion_tokens":7},'
    b'"metrics":{"speculative_decoding":{"num_spec_steps":3}}}',
    # Spaces and another key order: the same chunk.
    b'data: {"usage": {"completion_tokens": 7}, "id": "c", '
    b'"metrics": {"speculative_decoding": {"num_spec_steps": 3}}, "choices": [ ]}',
    b'data:{"choices" : [], "usage" : {"completion_tokens" : 7}, '
    b'"metrics" : {"speculative_decoding" : {"num_spec_steps" : 3}}}',
]


@pytest.mark.parametrize("usage_chunk", USAGE_CHUNKS)
@pytest.mark.parametrize("client_wants_usage", [False, True])
def test_the_usage_chunk_is_read_in_any_json_spelling(usage_chunk, client_wants_usage):
    from specserve.router.exchange import Exchange
    from specserve.router.record import RequestRecord

    record = RequestRecord(endpoint="chat", arm="a")
    sent = []

    async def send(message):
        sent.append(message)

    exchange = Exchange(
        record, send, [], (b"x-request-id", b"r"), client_wants_usage=client_wants_usage
    )
    # A content chunk that talks about "usage" (and an empty list) is not the usage chunk.
    content = b'data: {"choices":[{"delta":{"content":"\\"usage\\":{} \\"choices\\":[]"}}]}'
    events = [content, usage_chunk, b"data: [DONE]"]
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream"), (headers.ARM.encode(), b"a")],
    }

    async def stream():
        await exchange._send(start)
        for i, event in enumerate(events):
            body = event + b"\n\n"
            await exchange._send(
                {"type": "http.response.body", "body": body, "more_body": i < len(events) - 1}
            )

    asyncio.run(stream())
    assert record.output_tokens == 7 and record.spec_decode == {"num_spec_steps": 3}
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert content in out and out.endswith(b"data: [DONE]\n\n")
    assert (usage_chunk in out) == client_wants_usage  # dropped unless the client asked


def test_a_request_counts_among_the_proxys_ongoing_ones_until_it_ends(client):
    """Ray Serve stops a draining proxy once its count of ongoing requests is zero; requests
    the dispatch sends to arms do not pass through the proxy's own path, so it counts them."""

    class Proxy:  # what the dispatch wraps: Ray Serve's HTTP proxy, with its counter
        ongoing = 0

        def _ongoing_requests_start(self):
            self.ongoing += 1

        def _ongoing_requests_end(self):
            self.ongoing -= 1

    answer = asyncio.Event()

    async def held_arm(scope, receive, send):
        await receive()
        await answer.wait()
        start = {"type": "http.response.start", "status": 200}
        start["headers"] = [(b"content-type", b"application/json"), (headers.ARM.encode(), b"a")]
        await send(start)
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    proxy = Proxy()
    client.dispatch.app = proxy
    client.dispatch.arms = held_arm

    async def main():
        serving = asyncio.create_task(client.request())
        await asyncio.sleep(0.2)
        assert proxy.ongoing == 1
        answer.set()
        status, _, _ = await asyncio.wait_for(serving, 1)
        assert status == 200
        assert proxy.ongoing == 0

    run(main())


_ODD_CHARACTERS = st.one_of(
    st.integers(0xD800, 0xDFFF).map(chr),  # lone UTF-16 halves
    st.characters(codec="utf-8"),
    st.sampled_from(["\x00", "\u2028", "\ufeff", "😀", "\\"]),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    method=st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12),
    text=st.text(alphabet=_ODD_CHARACTERS, max_size=8),
    field=st.sampled_from(["user", "prompt", "model", "stop", "suffix", "key"]),
)
def test_odd_methods_and_strings_get_a_4xx_never_a_500(tmp_path_factory, method, text, field):
    """Any method name, and any string (lone surrogates included) in any field: the dispatch
    answers 405 or 400, or serves; never a 500, and never a method it does not route."""
    body: dict = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    if field == "key":
        body[text] = 1
    else:
        body[field] = text

    async def main(client):
        status, found, answer = await client.request(body=body, method=method or "POST")
        assert status < 500, answer
        if (method or "POST") not in {"GET", "HEAD", "POST", "OPTIONS"}:
            assert status == 405 and answer["error"]["code"] == "method_not_allowed"
            assert found[headers.ALLOW] == "GET, HEAD, OPTIONS, POST"
        if status == 200:
            # What the arm got encodes: the request never reached it otherwise.
            json.loads(client.arms.requests[-1]["body"]).__repr__().encode()

    # Hypothesis runs the examples in one test call: each patches and unpatches on its own.
    with pytest.MonkeyPatch.context() as patch:
        run(main(Client(tmp_path_factory.mktemp("odd"), patch, weight_b=1)))


@pytest.mark.parametrize("field", ["user", "prompt"])
def test_a_lone_surrogate_gets_400_and_a_real_pair_is_served(client, field):
    async def main():
        lone = {"model": MODEL, "prompt": "hi", field: "a\ud800"}
        status, _, answer = await client.request(body=lone)
        assert status == 400 and "surrogate" in answer["error"]["message"]
        paired = {"model": MODEL, "prompt": "hi", field: "a\ud83d\ude00"}  # one emoji, escaped
        assert (await client.request(body=paired))[0] == 200

    run(main())


def test_a_body_request_id_never_reaches_the_arm(client):
    async def main():
        own = {"model": MODEL, "prompt": "hi", "request_id": "not\nan id of ours"}
        assert (await client.request(body=own))[0] == 200
        assert "request_id" not in json.loads(client.arms.requests[-1]["body"])

    run(main())


def test_the_key_goes_no_further_on_the_routes_the_dispatch_passes_on(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch, exposed={"a"})

    async def main():
        await client.request(path="/v1/models", method="GET")
        await client.request(path="/arms/a/v1/completions", key=ADMIN_KEY)
        assert [r["path"] for r in client.arms.requests] == ["/v1/models", "/arms/a/v1/completions"]
        for passed in client.arms.requests:
            assert b"authorization" not in {name.lower() for name in passed["headers"]}

    run(main())


def test_each_key_gets_a_prefix_cache_of_its_own_when_configured(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch)
    client.config.write_text(
        client.config.read_text().replace(
            "body_timeout_s: 0.5", "body_timeout_s: 0.5, prefix_cache_per_key: true"
        )
    )

    async def main():
        await asyncio.sleep(0.3)  # the config is read again
        salts = []
        for key in (PUBLIC_KEY, ADMIN_KEY, PUBLIC_KEY):
            body = {"model": MODEL, "prompt": "hi", "cache_salt": "someone else's"}
            assert (await client.request(body=body, key=key))[0] == 200
            salts.append(json.loads(client.arms.requests[-1]["body"])["cache_salt"])
        assert salts[0] == salts[2] != salts[1] and "someone else's" not in salts

    run(main())


def test_without_the_setting_a_clients_own_salt_passes(client):
    async def main():
        body = {"model": MODEL, "prompt": "hi", "cache_salt": "mine"}
        assert (await client.request(body=body))[0] == 200
        assert json.loads(client.arms.requests[-1]["body"])["cache_salt"] == "mine"

    run(main())


@pytest.mark.parametrize("arm_header", ["admin", "everyone"])
def test_the_arm_is_named_to_admin_keys_only_unless_configured(tmp_path, monkeypatch, arm_header):
    """Told its arm, a client could try session ids until it had the arm it wants, and feed
    that arm's guardrail and A/B figures (docs/security.md)."""
    client = Client(tmp_path, monkeypatch, arm_header=arm_header)
    told = arm_header == "everyone"

    async def main():
        status, found, _ = await client.request(key=PUBLIC_KEY, extra={"x-session-id": "s1"})
        assert status == 200 and (headers.ARM in found) is told
        status, found, _ = await client.request(key=ADMIN_KEY, extra={"x-session-id": "s1"})
        assert status == 200 and found[headers.ARM] == "a"
        # An answer refused after the arm was chosen names it as rarely.
        too_long = {"model": MODEL, "prompt": "hi", "max_tokens": 10_000}
        status, found, _ = await client.request(body=too_long, key=PUBLIC_KEY)
        assert status == 400 and (headers.ARM in found) is told
        status, found, _ = await client.request(body=too_long, key=ADMIN_KEY)
        assert status == 400 and found[headers.ARM] == "a"

    run(main())


def test_sticky_keys_are_hashed_with_the_deployments_salt(tmp_path, monkeypatch):
    client = Client(tmp_path, monkeypatch, weight_b=1, sticky_salt="deployment secret")
    salt = load_salt(str(tmp_path / "sticky-salt"))
    weights = {"a": 1.0, "b": 1.0}

    def moved(to: str) -> str:
        """A session id the salt sends to `to`, the plain hash to the other arm."""
        return next(
            f"s{i}"
            for i in range(1000)
            if sticky_arm(f"s{i}", weights, salt) == to != sticky_arm(f"s{i}", weights)
        )

    async def main():
        # First to b, then to a: arm a's first answer drains it (the fake arm's acceptance is
        # below the guardrail's floor), so nothing is sent there before.
        for arm in ("b", "a"):
            session = moved(arm)
            status, found, _ = await client.request(key=ADMIN_KEY, extra={"x-session-id": session})
            assert status == 200 and found[headers.ARM] == arm

    run(main())


def test_by_default_a_replay_stays_on_its_arm_so_a_poison_body_kills_one_arms_engines(
    tmp_path, monkeypatch
):
    client = Client(tmp_path, monkeypatch, weight_b=1, arm_header="everyone")

    async def main():
        client.arms.dead = {"a"}
        for i in range(6):
            body = {"model": MODEL, "prompt": f"hi {i}"}
            status, found, _ = await client.request(body=body, extra={"x-session-id": f"s{i}"})
            assert status == 200 or status == 503
        arms_reached = [r["path"].split("/")[2] for r in client.arms.requests]
        # Each request that met the dead arm went there twice (the first try and its replay)
        # and never to b; the others were b's from the start.
        by_body: dict[bytes, list[str]] = {}
        for r in client.arms.requests:
            by_body.setdefault(r["body"], []).append(r["path"].split("/")[2])
        assert all(set(reached) == {"a"} or reached == ["b"] for reached in by_body.values())
        assert "a" in arms_reached and "b" in arms_reached

    run(main())
