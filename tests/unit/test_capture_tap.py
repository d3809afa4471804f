"""Taking a sampled request's token ids from the engine's answer (capture/tap.py), on answers
built with vLLM's own response classes as its OpenAI serving layer builds them with
`return_token_ids`: the ids are collected per choice and taken out of what the client gets,
unless it asked for them, and chunks that carried nothing but ids are dropped."""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from specserve.capture.tap import Tap, sampling_of

PROMPT = [1, 9, 9, 7]


def chat_stream(return_token_ids: bool) -> list[dict]:
    """A chat stream as vLLM's serving layer sends it, with or without `return_token_ids`."""

    def chunk(delta, token_ids, finish=None, **more):
        choice = ChatCompletionResponseStreamChoice(
            index=0,
            delta=delta,
            finish_reason=finish,
            token_ids=token_ids if return_token_ids else None,
        )
        return ChatCompletionStreamResponse(model="m", choices=[choice], **more)

    first = {"prompt_token_ids": PROMPT if return_token_ids else None}
    events = [
        chunk(DeltaMessage(role="assistant", content=""), None, **first),
        chunk(DeltaMessage(content="Hel"), [11]),
        *([chunk(DeltaMessage(), [12])] if return_token_ids else []),  # no text yet
        chunk(DeltaMessage(content="lo!"), [13, 14], finish="stop"),
        ChatCompletionStreamResponse(
            model="m", choices=[], usage=UsageInfo(prompt_tokens=4, completion_tokens=4)
        ),
    ]
    for e in events:  # one id and time for the whole stream, as vLLM gives
        e.id, e.created = "chatcmpl-1", 1
    return [json.loads(e.model_dump_json(exclude_unset=True)) for e in events]


def test_a_chat_stream_gives_one_record_and_the_client_the_stream_it_would_have_had():
    tap = Tap("eagle3", "chat", client_asked=False, stream=True)
    kept = [event for event in chat_stream(True) if tap.take(event)]
    assert kept == chat_stream(False)  # the chunk with only an id is gone, the ids are null
    (record,) = tap.records()
    assert record.prompt_token_ids == PROMPT and record.output_token_ids == [11, 12, 13, 14]
    assert (record.arm, record.endpoint, record.finish_reason) == ("eagle3", "chat", "stop")


def test_a_record_keeps_the_sampling_its_request_set():
    """What the gate scores under: the fields the request set, {} where it left all three to
    the engine's defaults."""
    sampled = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.7, top_k=20
    )
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert sampling_of(sampled) == {"temperature": 0.7, "top_k": 20.0}
    assert sampling_of(plain) == {}
    tap = Tap("eagle3", "chat", client_asked=False, stream=True, sampling=sampling_of(sampled))
    for event in chat_stream(True):
        tap.take(event)
    assert tap.records()[0].sampling == {"temperature": 0.7, "top_k": 20.0}


def test_a_client_that_asked_for_token_ids_keeps_them():
    tap = Tap("eagle3", "chat", client_asked=True, stream=True)
    kept = [event for event in chat_stream(True) if tap.take(event)]
    assert kept == chat_stream(True)
    assert tap.records()[0].output_token_ids == [11, 12, 13, 14]


def test_a_whole_chat_answer_with_two_choices_gives_two_records():
    choices = [
        ChatCompletionResponseChoice(
            index=i,
            message=ChatMessage(role="assistant", content=text),
            token_ids=ids,
            finish_reason="length",
        )
        for i, (text, ids) in enumerate((("a b", [5, 6]), ("c", [7])))
    ]
    answer = ChatCompletionResponse(
        model="m", choices=choices, usage=UsageInfo(prompt_tokens=4), prompt_token_ids=PROMPT
    ).model_dump(mode="json", exclude_none=True)
    tap = Tap("ngram", "chat", client_asked=False, stream=False)
    assert tap.take(answer)
    assert "token_ids" not in json.dumps(answer)
    assert answer["choices"][1]["message"]["content"] == "c"
    assert [(r.prompt_token_ids, r.output_token_ids) for r in tap.records()] == [
        (PROMPT, [5, 6]),
        (PROMPT, [7]),
    ]


@pytest.mark.parametrize("finished", [True, False])
def test_completions_carry_the_prompt_on_each_choice_and_an_unfinished_one_is_not_kept(finished):
    events = [
        CompletionStreamResponse(
            model="m",
            choices=[
                CompletionResponseStreamChoice(
                    index=0, text="x", prompt_token_ids=PROMPT, token_ids=[3]
                )
            ],
        ),
        CompletionStreamResponse(
            model="m",
            choices=[
                CompletionResponseStreamChoice(
                    index=0, text="y", token_ids=[4], finish_reason="stop" if finished else None
                )
            ],
        ),
    ]
    tap = Tap("no-spec", "completions", client_asked=False, stream=True)
    payloads = [json.loads(e.model_dump_json()) for e in events]
    assert all(tap.take(p) for p in payloads)
    assert all(p["choices"][0]["token_ids"] is None for p in payloads)
    records = tap.records()
    if finished:
        assert [(r.prompt_token_ids, r.output_token_ids) for r in records] == [(PROMPT, [3, 4])]
    else:
        assert records == []  # a stream cut short is not a sample of what the target says
