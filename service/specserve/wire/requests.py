"""The inference endpoints, and what the router checks in a request's body before it is routed:
a JSON object of bounded size and depth, this deployment's model, and the configured limits.

These checks depend on the config, so they run in the dispatch (the router in each HTTP proxy);
the request schema itself is checked by the arm that serves the request (wire/validation.py).
"""

from __future__ import annotations

import json
from typing import Any

from specserve.config import RouterConfig
from specserve.wire.errors import OpenAIError

CHAT, COMPLETIONS = "chat", "completions"
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
ENDPOINT_OF_PATH = {path: endpoint for endpoint, path in PATHS.items()}
# Readiness of the router to route: answered by the dispatch, from what it routes with.
READY_PATH = "/ready"
# Deeper JSON is refused before validation: no OpenAI request nests near this (a tool schema a
# few levels), and pydantic recurses once per level.
MAX_JSON_DEPTH = 64


def body_too_large(size: int | str, max_body_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body is {size} bytes; the limit is {max_body_bytes}")


def body_too_slow(timeout_s: float) -> OpenAIError:
    return OpenAIError(
        408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout"
    )


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 naming what is wrong with it otherwise."""
    try:
        data = json.loads(raw)
    except RecursionError:
        data = None  # nested beyond the parser's stack: refused below, before any walk
    except ValueError as exc:  # UnicodeDecodeError included
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
    # Only a body with more brackets than the limit can nest deeper than it (a C-speed count).
    too_deep = data is None or (
        raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(data, MAX_JSON_DEPTH)
    )
    if too_deep:
        raise OpenAIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return data


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def check_limits(data: dict[str, Any], config: RouterConfig) -> bool:
    """The model this deployment serves, and the configured bounds on tokens and choices. A
    request that names no token limit gets one, within the bounds: True when `data` was given
    one (its body must be written again)."""
    model = data.get("model")
    if model is None:
        raise OpenAIError(400, "model: field required", param="model")
    if model != config.model.name:
        raise unknown_model(model, config)
    limits = config.limits
    for key, most in (
        ("max_tokens", limits.max_tokens),
        ("max_completion_tokens", limits.max_tokens),
        ("n", limits.max_n),
    ):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON's 16.0 is an integer, as pydantic reads it
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OpenAIError(400, f"{key} must be a positive integer, got {value!r}", param=key)
        if value > most:
            raise OpenAIError(
                400, f"{key} is {value}; this deployment allows at most {most}", param=key
            )
    n = int(data.get("n") or 1)
    tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    if tokens is None:
        # Else the engine generates to the end of the context (131,072 tokens on some models).
        data["max_tokens"] = min(limits.max_tokens, max(1, limits.max_total_tokens // n))
        return True
    if n * int(tokens) > limits.max_total_tokens:
        raise OpenAIError(
            400,
            f"n x max_tokens is {n} x {int(tokens)}; this deployment allows at most "
            f"{limits.max_total_tokens} tokens per request",
            param="n",
        )
    return False


def wants_usage(data: dict[str, Any]) -> bool:
    """Whether the client asked for the final usage chunk of a stream (the arm always sends it:
    it carries the token count and the speculative-decoding stats)."""
    stream_options = data.get("stream_options")
    return isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))


def unknown_model(model: Any, config: RouterConfig) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {model!r} does not exist; this endpoint serves {config.model.name!r}",
        param="model",
        code="model_not_found",
    )
