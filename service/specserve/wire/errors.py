"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

4xx carry a message that says what to fix; 5xx are a bare "Internal Server Error" with the
traceback in the log under the request id.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import TaskCancelledError
from ray.serve.context import _get_serve_request_context
from starlette.exceptions import HTTPException

from specserve.headers import RETRY_AFTER

logger = logging.getLogger(__name__)

# What a client reads at the end of a stream whose engine failed mid-way.
MID_STREAM_FAILURE = "the model failed mid-stream; the answer is incomplete"
# Status of a response nobody receives (nginx's convention for a client that left).
CLIENT_CLOSED_REQUEST = 499
# A request refused because its arm is full: 429 (what OpenAI answers when overloaded, and what
# its clients back off on), and when to try again. Ray Serve answers so for the arms' queues
# (engine/arm.py) and the dispatch for its own bound on them.
OVERLOAD_STATUS = 429
OVERLOAD_RETRY_AFTER_S = 1
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"body", "str", "int", "float", "bool", "list", "dict", "none", "literal"})

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")


def arm_overloaded(arm: str, retry_after: str) -> OpenAIError:
    return OpenAIError(
        OVERLOAD_STATUS,
        f"arm {arm!r} is at capacity (its request queue is full); retry after {retry_after} s",
        code="arm_overloaded",
        headers={RETRY_AFTER: retry_after},
    )


def request_id() -> str:
    """Ray Serve's id of the request being handled: its proxy generates it (or takes the client's
    `x-request-id`) and returns it in the response's `x-request-id` header. Ray exposes the
    request context only through this private accessor."""
    return _get_serve_request_context().request_id or "-"


def error_body(status: int, message: str, *, param=None, code=None, type=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": type or _TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


# The event every OpenAI stream ends with.
SSE_DONE = "data: [DONE]\n\n"


def error_event(status: int, message: str) -> str:
    """The end of a stream cut short: an OpenAI error event, then `[DONE]`."""
    return f"data: {json.dumps(error_body(status, message))}\n\n{SSE_DONE}"


def error_response(err: OpenAIError) -> JSONResponse:
    body = error_body(err.status, err.message, param=err.param, code=err.code, type=err.type)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first problem of a pydantic validation error, named by its field. A field of several
    types (`stop`: a string or a list of at most 4) fails once per type: where the value has one
    of them and breaks its limit, that limit is the problem, not the other types it is not."""
    errors = exc.errors()
    field = _field(errors[0])
    first = next((e for e in errors if not _is_type_mismatch(e) and _field(e) == field), errors[0])
    loc = _field(first)
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return OpenAIError(400, message, param=param)


def _field(error: Any) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if _names_a_field(p)]


def _is_type_mismatch(error: Any) -> bool:
    """Whether pydantic found a value of another type (or shape) than the one it tried."""
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in ("literal_error", "missing")


def _names_a_field(part: object) -> bool:
    """Whether a pydantic error location part is a field name or list index, not the tag of a
    union member or type (`ChatCompletionUserMessageParam`, `str`, `list[constrained-int]`)."""
    if isinstance(part, int):
        return True
    return bool(_FIELD_NAME.fullmatch(str(part))) and part not in _TYPE_TAGS


def install_error_handlers(app: FastAPI, headers: dict[str, str] | None = None) -> None:
    """OpenAI-style answers for every error `app` raises; `headers` go on each of them."""

    def answer(err: OpenAIError) -> JSONResponse:
        err.headers = {**(headers or {}), **(err.headers or {})}
        return error_response(err)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(from_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return answer(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, TaskCancelledError):
            # The client went away mid-stream (Ray Serve cancels the request): no one to answer.
            logger.info("request %s: client disconnected", request_id())
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        logger.exception("request %s failed", request_id())
        return answer(OpenAIError(500, "Internal Server Error", type="server_error"))
