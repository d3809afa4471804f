"""Capture on the session platform (real Ray, vLLM and the real model): turned on for one arm
by a config change that restarts no engine, it keeps each sampled request's prompt token ids
as the engine saw them (the chat template applied) and the ids the target produced, while the
client gets the answer it would have had; a client's opt-out header and an arm without capture
keep a request out; the counts are metrics; `specserve capture stats | purge` show and delete."""

from __future__ import annotations

import time

import openai

from specserve import headers
from specserve.capture import store
from specserve.cli import main as cli
from specserve.metrics import CAPTURED_RECORDS
from specserve.models import resolve_model_source
from specserve.wire.requests import CHAT, COMPLETIONS, prompt_digest
from tests.conftest import ADMIN_KEY, MODEL, render_config

ARM = "ngram"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"


def with_capture(config: str) -> str:
    head = f"  - name: {ARM}\n"
    assert head in config
    return config.replace(head, head + "    capture: {sample: 1.0, max_records: 1000}\n", 1)


def wait_for_records(directory, n: int, timeout_s: float = 15) -> list[store.Record]:
    deadline = time.monotonic() + timeout_s
    while len(records := list(store.read(directory, arm=ARM))) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(records)} records captured, expected {n}")
        time.sleep(0.2)
    return records


def test_sampled_requests_are_captured_as_the_engine_saw_them(live, restore_config, capsys):
    from transformers import AutoTokenizer

    store.purge(live.capture_dir)
    before = live.metric(CAPTURED_RECORDS + "_total", arm=ARM)
    live.write_config(with_capture(render_config()))  # the router's setting: live
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    forced = {headers.ARM_OVERRIDE: ARM}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_headers=forced
    )
    assert "prompt_token_ids" not in (chat.model_extra or {})
    assert "token_ids" not in (chat.choices[0].model_extra or {})
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_headers=forced,
    )
    chunks = list(streamed)
    # vLLM's chunks name the id fields (null) whether or not ids were asked for.
    assert not any((c.model_extra or {}).get("prompt_token_ids") for c in chunks)
    assert not any((c.choices[0].model_extra or {}).get("token_ids") for c in chunks if c.choices)
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_headers=forced
    )
    # Kept out: a client's opt-out, and an arm without capture.
    client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        extra_headers={**forced, headers.NO_CAPTURE: "1"},
    )
    client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        extra_headers={headers.ARM_OVERRIDE: "no-spec"},
    )

    records = wait_for_records(live.capture_dir, 3)
    time.sleep(1)  # nothing more arrives
    records = list(store.read(live.capture_dir))
    assert [(r.arm, r.endpoint) for r in records] == [
        (ARM, "chat"),
        (ARM, "chat"),
        (ARM, "completions"),
    ]
    assert {r.key for r in records} == {"test-admin"}  # the name of the key that sent them
    # The router's digest of each prompt, what the loop leaves an A/B's repeats out by.
    asked = prompt_digest({"messages": MESSAGES}, CHAT)
    assert [r.prompt_digest for r in records] == [
        asked,
        asked,
        prompt_digest({"prompt": PROMPT}, COMPLETIONS),
    ]
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_source(live.platform.loaded.config.model.source)
    )
    templated = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert records[0].prompt_token_ids == records[1].prompt_token_ids == expected
    text = tokenizer.decode(records[0].output_token_ids, skip_special_tokens=True)
    assert text == chat.choices[0].message.content == streamed_text  # greedy: the same answer
    assert records[2].prompt_token_ids == tokenizer.encode(PROMPT)
    assert tokenizer.decode(records[2].output_token_ids) == completion.choices[0].text
    assert len(records[0].output_token_ids) == chat.usage.completion_tokens
    live.wait_for_metric(CAPTURED_RECORDS + "_total", before + 3, arm=ARM)

    assert cli(["capture", "stats", "--dir", str(live.capture_dir)]) == 0
    assert f"{ARM:<20} {3:>9}" in capsys.readouterr().out
    assert cli(["capture", "purge", "--dir", str(live.capture_dir), "--arm", ARM]) == 0
    assert "deleted 3 record(s)" in capsys.readouterr().out
    assert list(store.read(live.capture_dir)) == []
