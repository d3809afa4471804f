"""The dispatch's calls to the arms (wire/arm_calls.py), both halves over a real Ray Serve
handle: a small FastAPI app in a Ray Serve deployment named as an arm's, served by `serve_app`,
called through `ArmCalls` as the dispatch calls it."""

from __future__ import annotations

import asyncio
import json
import pickle
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specserve import headers
from specserve.wire.arm_calls import ArmCalls, serve_app
from tests.conftest import own_ray_cluster

ARM = "probe"


def front() -> FastAPI:
    """Answers as an arm's front does: JSON, or a stream of events, or a failure."""
    app = FastAPI()
    app.state.cancelled = asyncio.Event()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen = {"path": request.url.path, "body": body, "headers": dict(request.headers)}
        if body.get("fail"):
            raise RuntimeError("the engine failed")
        if not body.get("stream"):
            return JSONResponse(seen, headers={headers.ARM: ARM})

        async def events():
            try:
                for i in range(body.get("events", 3)):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(body.get("pause_s", 0))
            except asyncio.CancelledError:
                app.state.cancelled.set()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def collect(app, request: bytes) -> list[list[dict]]:
    return [pickle.loads(batch) async for batch in serve_app(app, request)]


def scope(path: str = "/v1/completions") -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }


def test_the_replica_runs_the_app_on_the_body_and_returns_its_answer():
    request = pickle.dumps((scope(), json.dumps({"prompt": "hi"}).encode()))
    batches = asyncio.run(collect(front(), request))
    messages = [m for batch in batches for m in batch]
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["status"] == 200
    assert (headers.ARM.encode(), ARM.encode()) in messages[0]["headers"]
    assert json.loads(messages[1]["body"])["body"] == {"prompt": "hi"}


def test_a_failing_app_answers_500_and_the_failure_is_raised_after_it():
    request = pickle.dumps((scope(), json.dumps({"fail": True}).encode()))
    sent: list[dict] = []

    async def run():
        async for batch in serve_app(front(), request):
            sent.extend(pickle.loads(batch))

    with pytest.raises(RuntimeError, match="the engine failed"):
        asyncio.run(run())
    assert sent[0]["status"] == 500


def test_closing_the_replicas_generator_cancels_the_app():
    app = front()
    body = json.dumps({"stream": True, "events": 1000, "pause_s": 0.01}).encode()

    async def run():
        generator = serve_app(app, pickle.dumps((scope(), body)))
        first = pickle.loads(await anext(generator))
        await generator.aclose()  # what Ray Serve does when the caller cancels
        await asyncio.wait_for(app.state.cancelled.wait(), 5)
        return first

    first = asyncio.run(run())
    assert first[0]["type"] == "http.response.start"


@pytest.fixture(scope="module")
def arm_deployment():
    """A Ray Serve application named as arm `probe`'s, serving `front()` through `serve_app`."""
    from ray import serve

    from specserve.config.serve_config import arm_app_name
    from specserve.wire.arm_calls import ARM_METHOD

    async def dispatched(self, request: bytes):
        async for batch in serve_app(self.app, request):
            yield batch

    def cancelled(self) -> bool:
        return self.app.state.cancelled.is_set()

    deployment_cls = type("Probe", (), {"__init__": lambda self: setattr(self, "app", front())})
    setattr(deployment_cls, ARM_METHOD, dispatched)
    deployment_cls.cancelled = cancelled
    name = arm_app_name(ARM)
    app = serve.deployment(
        name=name,
        max_ongoing_requests=1,
        max_queued_requests=1,
        backpressure_config={"status_code": 429, "retry_after_s": 1.5},
    )(deployment_cls).bind()
    with own_ray_cluster(num_cpus=2, include_dashboard=False, log_to_driver=False):
        serve.run(app, name=name, route_prefix=None)
        yield
        serve.shutdown()


async def call(calls: ArmCalls, body: dict, *, leave_after_s: float | None = None):
    sent: list[dict] = []
    arm_scope = {**scope(f"/arms/{ARM}/v1/completions"), "headers": [(b"x-request-id", b"r-1")]}
    given = False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": json.dumps(body).encode()}
        if leave_after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await calls(arm_scope, receive, send)
    return sent


@pytest.mark.own_cluster
def test_a_call_reaches_the_arms_app_with_the_body_and_the_arms_path(arm_deployment):
    sent = asyncio.run(call(ArmCalls(), {"prompt": "hi"}))
    assert sent[0]["status"] == 200
    seen = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert seen["path"] == "/v1/completions"
    assert seen["body"] == {"prompt": "hi"}


@pytest.mark.own_cluster
def test_a_stream_arrives_whole_and_in_order(arm_deployment):
    sent = asyncio.run(call(ArmCalls(), {"stream": True, "events": 20}))
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert text == b"".join(f"data: {i}\n\n".encode() for i in range(20))
    assert not sent[-1].get("more_body", False)


@pytest.mark.own_cluster
def test_a_full_arm_is_refused_with_ray_serves_status_and_no_arm_header(arm_deployment):
    async def run():
        calls = ArmCalls()
        stream = {"stream": True, "events": 50, "pause_s": 0.05}
        longs = []
        for _ in range(2):  # one in the replica's one place, then one in its queue of one
            longs.append(asyncio.ensure_future(call(calls, stream)))
            await asyncio.sleep(1.0)
        refused = await call(calls, {"prompt": "hi"})
        await asyncio.gather(*longs)
        return refused

    refused = asyncio.run(run())
    start = refused[0]
    assert start["status"] == 429
    assert all(name != headers.ARM.encode() for name, _ in start["headers"])
    retry_after = [
        value for name, value in start["headers"] if name == headers.RETRY_AFTER.encode()
    ]
    assert retry_after == [b"2"]  # whole seconds as HTTP has them, rounded up


@pytest.mark.own_cluster
def test_a_client_leaving_ends_the_call_without_more_answer(arm_deployment):
    async def run():
        return await asyncio.wait_for(
            call(ArmCalls(), {"stream": True, "events": 1000, "pause_s": 0.01}, leave_after_s=1),
            10,
        )

    sent = asyncio.run(run())
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies and bodies[-1].get("more_body", False)  # cut, not finished
    # ... and the replica's app was cancelled (its engine's request would be aborted).
    from ray import serve

    from specserve.config.serve_config import arm_app_name

    replica = serve.get_deployment_handle(arm_app_name(ARM), arm_app_name(ARM))
    deadline = time.monotonic() + 10
    while not replica.cancelled.remote().result():
        assert time.monotonic() < deadline, "the replica's app ran on after the client left"
        time.sleep(0.1)
