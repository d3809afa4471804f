"""The arm's front answers a request that outlives its time limit with 504, also when the
engine catches the cancellation and answers instead (vLLM's full generators answer a cancelled
request with a 400 "Client disconnected", which reached clients as if their request were bad)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specserve.engine.front import respond
from specserve.wire.errors import OpenAIError


async def engine_that_swallows_cancellation():
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        # What vLLM's chat_completion_full_generator does.
        yield SimpleNamespace(error=SimpleNamespace(code=400, message="Client disconnected"))


def test_a_request_past_its_limit_gets_504_even_when_the_engine_swallows_the_cancel():
    async def main():
        body = SimpleNamespace(stream=False)
        with pytest.raises(OpenAIError) as caught:
            await respond(engine_that_swallows_cancellation(), body, {}, timeout_s=0.2)
        assert caught.value.status == 504

    asyncio.run(main())


def test_an_engine_error_is_logged_by_its_code_never_its_text(caplog):
    secret = "the user's prompt: my password is hunter2"

    async def failing_engine():
        yield SimpleNamespace(
            error=SimpleNamespace(code=500, message=secret, type="InternalServerError", param=None)
        )

    async def main():
        with pytest.raises(OpenAIError) as caught:
            await respond(failing_engine(), SimpleNamespace(stream=False), {}, timeout_s=5)
        assert caught.value.status == 500 and "hunter2" not in caught.value.message

    with caplog.at_level("DEBUG"):
        asyncio.run(main())
    assert "engine error 500 (InternalServerError)" in caplog.text
    assert "hunter2" not in caplog.text
