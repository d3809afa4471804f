"""The request's trip from the dispatch (in each HTTP proxy) to an arm's replica: one Ray Serve
handle call that streams the arm's HTTP answer back as ASGI messages.

Ray Serve's own HTTP path to a replica costs the replica a second actor call back to the proxy
for the request's body (and a third that waits for the client to leave), the proxy's routing
by path, and one streamed object per ASGI message. The dispatch has the whole body already and
knows the arm, so it sends both in the call itself, over Ray Serve's gRPC transport; the replica
runs its front's ASGI app (engine/front.py) in process and returns the messages that are ready
together as one object (never holding one back to wait for another).
What the client sees is the same: the arm's app answers, Ray Serve's refusals (a full queue, no
replica) become the status Ray Serve's proxy would have answered, and a replica that dies sends
nothing more, as with Ray Serve's proxy (the dispatch replays or ends the request).

`ArmCalls` is the proxy's half (an ASGI app for the arms' routes, `/arms/<name>/...`);
`serve_app` the replica's.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import ray.serve.context
from ray.serve._private.constants import (
    RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING,
    RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
)
from ray.serve._private.http_util import (
    get_http_response_status,
    send_http_response_on_exception,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specserve import headers
from specserve.config.serve_config import ARM_ROUTE_PREFIX, arm_app_name

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The replica method that serves a dispatched request (engine/front.py).
ARM_METHOD = "dispatched"
# What a replica's app is given of the proxy's scope (the rest holds the proxy's own objects).
_SCOPE_KEYS = ("http_version", "method", "scheme", "query_string", "headers", "client", "server")
_REQUEST_ID = headers.REQUEST_ID.encode()


class ArmCalls:
    """An ASGI app for `/arms/<name>/<path>`: the request goes to a replica of arm `<name>` over
    a Ray Serve handle (one per arm, kept for the proxy's life). The request's body is the first
    message `receive` gives; a later one (the client leaving) cancels the call."""

    def __init__(self) -> None:
        self._handles: dict[str, DeploymentHandle] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arm, _, path = scope["path"].removeprefix(ARM_ROUTE_PREFIX).partition("/")
        first = await receive()
        request = pickle.dumps((_replica_scope(scope, "/" + path), first.get("body", b"")))
        request_id = next((v for k, v in scope["headers"] if k == _REQUEST_ID), b"").decode()
        call = asyncio.ensure_future(self._call(arm, request, request_id, send))
        # `receive` returns again only when the client leaves: the call is cancelled then.
        left = asyncio.ensure_future(receive())
        left.add_done_callback(lambda _: call.cancel())
        try:
            await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not left.done() or (current is not None and current.cancelling()):
                raise  # cancelled from outside (not the client leaving)
        finally:
            left.cancel()
            call.cancel()
            if left.done() and not left.cancelled():
                left.exception()  # read, so that asyncio does not report it as lost

    async def _call(self, arm: str, request: bytes, request_id: str, send: Send) -> None:
        # Ray Serve takes the request's id (the replica's logs) from the caller's context.
        ray.serve.context._serve_request_context.set(
            ray.serve.context._RequestContext(  # type: ignore[arg-type]  # typed None by default
                route=ARM_ROUTE_PREFIX + arm, request_id=request_id, app_name=arm_app_name(arm)
            )
        )
        response: DeploymentResponseGenerator[bytes] = self._handle(arm).remote(request)  # type: ignore[assignment]  # a streaming handle's
        started = False
        try:
            async for payload in response:
                for message in pickle.loads(payload):
                    started = True
                    await send(message)
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as exc:
            # Answered as Ray Serve's proxy answers a failed call, with its own functions: before
            # any answer, its refusals (a full queue: the configured status and Retry-After; no
            # replica: 503); otherwise nothing more (a replica that died), the failure logged.
            status = get_http_response_status(exc, None, request_id)
            for message in send_http_response_on_exception(status, started):
                await send(message)

    def _handle(self, arm: str) -> DeploymentHandle:
        handle = self._handles.get(arm)
        if handle is None:
            name = arm_app_name(arm)  # the arm's application and its one deployment
            base: DeploymentHandle[Any] = DeploymentHandle(name, name)
            base._init(
                _prefer_local_routing=RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING,
                _run_router_in_separate_loop=RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
            )
            # Over Ray Serve's gRPC transport to the replica rather than Ray's actor calls:
            # 1-4 ms less per request on 2 cores (BENCHMARKS.md, "The platform's own cost").
            handle = self._handles[arm] = base.options(
                stream=True, method_name=ARM_METHOD, _by_reference=False
            )
        return handle


async def serve_app(app: ASGIApp, request: bytes) -> AsyncIterator[bytes]:
    """The replica's half: run `app` on a request from `ArmCalls`; yield its ASGI messages,
    those ready together as one pickled list. Cancelling the generator cancels the app."""
    scope, body = pickle.loads(request)
    outbox: asyncio.Queue[Message | None] = asyncio.Queue()
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Future()  # never: the client leaving arrives as a cancellation
        raise AssertionError

    async def send(message: Message) -> None:
        outbox.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: outbox.put_nowait(None))
    try:
        while True:
            batch = [await outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            messages = [message for message in batch if message is not None]
            if messages:
                yield pickle.dumps(messages)
            if batch[-1] is None:
                break
        task.result()  # the app's failure, after what it answered
    finally:
        task.cancel()


def _replica_scope(scope: Scope, path: str) -> dict[str, Any]:
    kept = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
    return {
        **kept,
        "type": "http",
        # ASGI 2.4: the app learns of a client leaving by cancellation, not by `receive`.
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
    }
