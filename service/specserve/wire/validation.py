"""The request schema, checked by the arm that serves the request: vLLM's own request models, plus
what they admit but the engine then fails on. The router has already checked size, model and
limits (wire/requests.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from vllm.exceptions import VLLMValidationError

from specserve.wire.errors import OpenAIError, from_validation_error
from specserve.wire.requests import CHAT, COMPLETIONS, as_bool

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
}
MAX_TOKEN_ID = 2**32  # what a tokenizer's id type holds


def validate_request(data: dict[str, Any], endpoint: str) -> Any:
    """The request as the engine takes it, every stream asking for the final usage chunk."""
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(key)
        if isinstance(value, float) and value.is_integer():
            data[key] = int(value)  # JSON's 16.0 is an integer, as pydantic reads it
    if endpoint == CHAT and not isinstance(data.get("messages", []), list):
        # vLLM's before-validators iterate `messages` unchecked: a number would be a TypeError.
        raise OpenAIError(400, "messages: must be an array of messages", param="messages")
    stream_options = data.get("stream_options")
    if as_bool(data.get("stream")) and (stream_options is None or isinstance(stream_options, dict)):
        # Read as the validation reads a bool ("stream": 1 streams too): the final usage chunk
        # carries the token count the key is charged and the spec-decode stats.
        data = {**data, "stream_options": {**(stream_options or {}), "include_usage": True}}
    body = _validate(data, endpoint)
    if endpoint == CHAT:
        _check_roles(data["messages"])
    else:
        _check_token_ids(data.get("prompt"))
    return body


def _validate(data: dict[str, Any], endpoint: str) -> Any:
    try:
        return REQUEST_MODELS[endpoint].model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except TypeError as exc:
        # Another of vLLM's validators meeting a type it does not check for: still the request's
        # fault, and the message names what it tripped over.
        raise OpenAIError(400, f"invalid request: {exc}") from None
    except VLLMValidationError as exc:
        # vLLM's model validators check parameter combinations (structured outputs, logprobs,
        # stream options) by raising their own error, which pydantic passes through.
        param = exc.parameter
        message = exc.args[0] if exc.args else str(exc)
        raise OpenAIError(400, f"{param}: {message}" if param else message, param=param) from None


def _check_roles(messages: list[Any]) -> None:
    """vLLM's message schema admits a message without a role (a loose custom type) and then
    fails on it while rendering the prompt: refuse it here."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("role") if isinstance(message, dict) else None, str):
            param = f"messages.{i}.role"
            raise OpenAIError(400, f"{param}: every message needs a string role", param=param)


def _check_token_ids(prompt: Any) -> None:
    """Token ids the tokenizer cannot even hold (>= 2**32) crash it when the prompt is echoed;
    smaller unknown ids are the engine's to refuse."""
    if not isinstance(prompt, list):
        return
    rows = prompt if prompt and all(isinstance(p, list) for p in prompt) else [prompt]
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if isinstance(token, int) and token >= MAX_TOKEN_ID:
                param = f"prompt.{i}.{j}" if rows is prompt else f"prompt.{j}"
                raise OpenAIError(400, f"{param}: token id {token} is out of range", param=param)
