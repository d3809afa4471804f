"""The inference endpoints, and what the router checks in a request's body before it is routed:
a JSON object of bounded size and depth, this deployment's model, and the configured limits.

These checks depend on the config, so they run in the dispatch (the router in each HTTP proxy);
the request schema itself is checked by the arm that serves the request (wire/validation.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from specserve.config.schema import RouterConfig
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
    # JSON may escape half of a UTF-16 pair (\ud800) where UTF-8 has no such character: a string
    # that cannot be encoded fails wherever it is hashed, tokenized or logged.
    if (b"\\ud" in raw or b"\\uD" in raw) and _has_lone_surrogate(data):
        raise OpenAIError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    return data


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
    return False


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


@dataclass(frozen=True)
class Checked:
    """What `check_limits` found: the most tokens the engine may generate for the request, and
    whether it changed the body (which must then be written again)."""

    tokens: int
    rewritten: bool


def check_limits(data: dict[str, Any], config: RouterConfig, endpoint: str) -> Checked:
    """The model this deployment serves, and the configured bounds on tokens and choices,
    counted as the engine will generate them: every prompt of a completion, times `n`, times the
    token limit the engine honours. A request that names no token limit gets one, within the
    bounds; `stream` is written as the bool the arm's validation reads it as."""
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
    rewritten = _decide_stream(data)
    n = int(data.get("n") or 1)
    prompts = prompt_count(data, endpoint)
    field = output_limit_field(data, endpoint)
    if data.get(field) is None:
        # Else the engine generates to the end of the context (131,072 tokens on some models).
        data[field] = min(limits.max_tokens, max(1, limits.max_total_tokens // (n * prompts)))
        rewritten = True
    tokens = int(data[field])
    total = prompts * n * tokens
    if total > limits.max_total_tokens:
        counted = f"n x {field} is {n} x {tokens}"
        if prompts > 1:
            counted = f"prompts x n x {field} is {prompts} x {n} x {tokens}"
        raise OpenAIError(
            400,
            f"{counted} = {total} tokens; this deployment allows at most "
            f"{limits.max_total_tokens} tokens per request",
            param=field,
        )
    return Checked(tokens=total, rewritten=rewritten)


def prompt_count(data: dict[str, Any], endpoint: str) -> int:
    """How many prompts the engine answers: a chat has one; a completion's `prompt` is one text
    or one list of token ids, or a list of several, and `prompt_embeds` adds its own."""
    if endpoint == CHAT:
        return 1
    count = 0
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        count += len(prompt)
    elif prompt is not None:
        count += 1
    embeds = data.get("prompt_embeds")
    if isinstance(embeds, list):
        count += len(embeds)
    elif embeds is not None:
        count += 1
    return max(1, count)


_SPACES = re.compile(r"\s+")
_NUMBERS = re.compile(r"\d+")


def prompt_digest(data: dict[str, Any], endpoint: str) -> str:
    """16 hex digits of what a request asks: a chat's roles and message texts, a completion's
    prompt. Case, runs of spaces and the values of numbers do not count (a template with a
    number changed is the same prompt): the router and the capture store name prompts by it, so
    the loop can leave the A/B's repeats of training prompts out (routing.ab_left_out_prompts)."""
    if endpoint == CHAT:
        messages = data.get("messages")
        asked: Any = [
            [m.get("role"), _text(m.get("content"))]
            for m in (messages if isinstance(messages, list) else [])
            if isinstance(m, dict)
        ]
    else:
        asked = data.get("prompt")
    text = json.dumps(_normalized(asked), ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(errors="replace"), digest_size=8).hexdigest()


def _normalized(value: Any) -> Any:
    """Texts without case, runs of spaces or numbers' values; token ids as they are."""
    if isinstance(value, str):
        return _NUMBERS.sub("0", _SPACES.sub(" ", value.casefold()).strip())
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _text(content: Any) -> Any:
    """A message's text: its string, or its text parts joined (other parts as they are)."""
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and "text" in p]
        if len(texts) == len(content):
            return " ".join(str(t) for t in texts)
    return content


def output_limit_field(data: dict[str, Any], endpoint: str) -> str:
    """The token limit the engine honours: a chat's `max_completion_tokens` over its
    `max_tokens`; a completion knows only `max_tokens` (vLLM ignores the other there)."""
    if endpoint == CHAT and data.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


_BOOL = TypeAdapter(bool)


def as_bool(value: Any) -> bool | None:
    """`value` as the arm's validation (pydantic) reads a bool: 1, "true", "on" ... are True;
    None when it reads none."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return None


def _decide_stream(data: dict[str, Any]) -> bool:
    """Write `stream` as the bool the arm will take it for, so that the router, which forces the
    usage chunk of every stream and charges its tokens, decides as the engine does: True when
    the body changed."""
    if "stream" not in data or data["stream"] is None or isinstance(data["stream"], bool):
        return False
    stream = as_bool(data["stream"])
    if stream is None:
        return False  # not a bool at all: the arm's validation refuses it, naming the field
    data["stream"] = stream
    return True


CACHE_SALT = "cache_salt"  # vLLM's: prompts share cached blocks only under the same salt


def salt_for_key(data: dict[str, Any], key_name: str) -> None:
    """Put the request in its API key's own prefix cache, whatever salt the client sent."""
    data[CACHE_SALT] = hashlib.sha256(f"specserve-key:{key_name}".encode()).hexdigest()


def wants_usage(data: dict[str, Any]) -> bool:
    """Whether the client asked for the final usage chunk of a stream (the arm always sends it:
    it carries the token count and the speculative-decoding stats)."""
    stream_options = data.get("stream_options")
    return isinstance(stream_options, dict) and bool(as_bool(stream_options.get("include_usage")))


# Sampling that vLLM's speculative decoding refuses (SamplingParams' check against a
# speculative config): a request asking for it goes to an arm without speculation.
MIN_P_EPS = 1e-5  # vLLM's own threshold for a min_p that samples


def needs_plain_decoding(data: dict[str, Any]) -> str | None:
    """The field of the request that an arm which speculates cannot serve, if any. A value
    of the wrong type is the arm's validation's to refuse."""
    if isinstance(data.get("logit_bias"), dict) and data["logit_bias"]:
        return "logit_bias"
    min_p = data.get("min_p")
    if isinstance(min_p, int | float) and not isinstance(min_p, bool) and min_p > MIN_P_EPS:
        return "min_p"
    return None


def unknown_model(model: Any, config: RouterConfig) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {model!r} does not exist; this endpoint serves {config.model.name!r}",
        param="model",
        code="model_not_found",
    )
