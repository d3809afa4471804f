"""A request's ASGI scope as Ray Serve's proxy hands it to the dispatch, and as the dispatch
passes it on to an arm (router/dispatch.py): its headers, its body, its id."""

from __future__ import annotations

import asyncio
import re
import uuid

from specserve import headers
from specserve.capture.store import Sampled
from specserve.config.schema import LimitsConfig
from specserve.config.serve_config import ARM_ROUTE_PREFIX
from specserve.wire.arm_calls import Receive, Scope
from specserve.wire.errors import OpenAIError
from specserve.wire.requests import body_too_large, body_too_slow
from specserve.wire.resume import ResumePoint

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "OPTIONS"})  # what any route here answers
_TIMEOUT = headers.REQUEST_TIMEOUT_S.encode()
_RESUME_FROM = headers.RESUME_FROM.encode()
_CAPTURE = headers.CAPTURE.encode()
# Request headers a client may not pass on to an arm: its key, the platform's own (any under
# the internal prefix, `_passes_to_arm`), and those that steer Ray Serve.
_NOT_FORARMS = frozenset(
    name.encode() for name in (headers.AUTHORIZATION, *headers.RAY_SERVE_STEERING)
)
_INTERNAL_PREFIX = headers.INTERNAL_PREFIX.encode()
_REQUEST_ID_SHAPE = re.compile(headers.REQUEST_ID_PATTERN.encode())


class ClientGone(Exception):
    """The client disconnected."""


async def read_body(
    request_headers: dict[str, str], receive: Receive, limits: LimitsConfig
) -> bytes:
    """The whole request body, refused as soon as it is known to pass the size limit (413) or
    to arrive later than the deadline (408)."""
    max_body_bytes = limits.max_body_bytes
    declared = request_headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise body_too_large(int(declared), max_body_bytes)
    chunks, size = [], 0
    deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise body_too_slow(limits.body_timeout_s) from None
        if message["type"] == "http.disconnect":
            raise ClientGone  # before it had sent its request
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            raise body_too_large(f"more than {size - 1}", max_body_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header_dict(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def arm_scope(
    scope: Scope,
    arm: str,
    timeout_s: float,
    resume: ResumePoint | None = None,
    *,
    capture: Sampled | None = None,
) -> Scope:
    """The request as the proxy routes it to the arm's application (resumed from `resume`; its
    token ids kept by the arm within `capture`'s bounds)."""
    path = ARM_ROUTE_PREFIX + arm + scope["path"]
    # The time limit is the config's; the client's key and the headers that steer Ray Serve
    # stay behind.
    kept = [(name, value) for name, value in scope["headers"] if _passes_to_arm(name)]
    kept.append((_TIMEOUT, repr(timeout_s).encode()))
    if resume is not None:
        kept.append((_RESUME_FROM, resume.header().encode()))
    if capture is not None:
        kept.append((_CAPTURE, capture.header().encode()))
    return {**scope, "path": path, "raw_path": path.encode(), "headers": kept}


def _passes_to_arm(name: bytes) -> bool:
    name = name.lower()
    if name in _NOT_FORARMS or name.startswith(_INTERNAL_PREFIX):
        return False
    normalized = name.decode("latin-1").lower().replace("-", "_")
    return normalized != headers.RAY_SERVE_MULTIPLEXED_MODEL_ID


def without_key(scope: Scope) -> Scope:
    """The request without its API key: checked here, it goes no further."""
    name = headers.AUTHORIZATION.encode()
    return {**scope, "headers": [h for h in scope["headers"] if h[0].lower() != name]}


def request_id_header(scope: Scope) -> tuple[bytes, bytes]:
    """The request's id, as Ray Serve's proxy sets it on what it answers: the client's
    `x-request-id` if it has the expected shape (it reaches the logs), else a new one, also put
    on the request so the arm logs it under the same."""
    name = headers.REQUEST_ID.encode()
    found = [value for key, value in scope["headers"] if key == name]
    if len(found) == 1 and _REQUEST_ID_SHAPE.fullmatch(found[0]):
        return name, found[0]
    new = str(uuid.uuid4()).encode()
    scope["headers"] = [*(h for h in scope["headers"] if h[0] != name), (name, new)]
    return name, new


def method_not_allowed(method: str) -> OpenAIError:
    shown = method if len(method) <= 32 and method.isprintable() else f"{method[:32]!r}..."
    return OpenAIError(
        405,
        f"method {shown} is not allowed; routes here take {', '.join(sorted(HTTP_METHODS))}",
        code="method_not_allowed",
        headers={headers.ALLOW: ", ".join(sorted(HTTP_METHODS))},
    )
