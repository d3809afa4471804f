"""A request the schema refuses gets one message that says what to fix, named by its field."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.exceptions import VLLMValidationError

from specserve.engine.front import respond
from specserve.wire.errors import OpenAIError, error_response
from specserve.wire.requests import CHAT
from specserve.wire.validation import validate_request

MSG = [{"role": "user", "content": "hi"}]


def refusal(**fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        validate_request({"model": "m", "messages": MSG, **fields}, CHAT)
    return caught.value


def test_a_value_of_one_of_a_fields_types_is_told_the_limit_it_breaks():
    # `stop` is a string or a list of at most 4: a list of 5 breaks the list's limit; that it
    # is not a string is beside the point.
    err = refusal(stop=["a", "b", "c", "d", "e"])
    assert (err.status, err.param) == (400, "stop")
    assert "at most 4" in err.message, err.message


def test_a_value_of_none_of_a_fields_types_is_told_the_first_type():
    err = refusal(stop=5)
    assert (err.param, err.message) == ("stop", "stop: Input should be a valid string")


def test_a_single_type_fields_refusal_is_unchanged():
    err = refusal(temperature="hot")
    assert err.param == "temperature" and "valid number" in err.message


def test_an_engines_refusal_carries_openais_type_for_its_status():
    """vLLM's refusal names its exception class as the type ("BadRequestError"); the client
    gets OpenAI's type for the status, as the router's own refusals carry, and vLLM's text."""
    refused = create_error_response(
        VLLMValidationError("temperature must be non-negative", parameter="temperature")
    )
    assert refused.error.type == "BadRequestError"

    async def engine():
        yield refused

    async def main():
        await respond(engine(), SimpleNamespace(stream=False), {}, timeout_s=5)

    with pytest.raises(OpenAIError) as caught:
        asyncio.run(main())
    body = json.loads(error_response(caught.value).body)["error"]
    assert (body["type"], body["param"], body["code"]) == (
        "invalid_request_error",
        "temperature",
        400,
    )
    assert "non-negative" in body["message"]
