"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

4xx carry a message that says what to fix; 5xx are a bare "Internal Server Error" with the
traceback in the log under the request id.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from specserve.headers import REQUEST_ID

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
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


def error_body(status: int, message: str, *, param=None, code=None, type=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": type or _TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(err: OpenAIError) -> JSONResponse:
    body = error_body(err.status, err.message, param=err.param, code=err.code, type=err.type)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first problem of a pydantic validation error, named by its field."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return OpenAIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.headers.get(REQUEST_ID, "-")
        logger.exception("request %s failed", request_id)
        return error_response(OpenAIError(500, "Internal Server Error", type="server_error"))
