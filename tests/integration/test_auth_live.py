"""API keys and the admin surface on the real platform (the dispatch in Ray Serve's real HTTP
proxy, real engines), through the official OpenAI client: 401 without a key, 403 for a public
key forcing an arm, keys rotated by editing the file, Ray Serve's steering headers dropped, and
the counts by key name. And Ray's own door: the local cluster refuses a client without its
token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import openai
import pytest

from specserve import headers
from specserve.deploy import RAY_TOKEN_FILE
from specserve.metrics import API_KEY_OUTPUT_TOKENS, API_KEY_REQUESTS, NO_KEY
from tests.conftest import ADMIN_KEY, MODEL, PUBLIC, PUBLIC_KEY

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


def client(live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=key, max_retries=0)


def test_a_wrong_key_is_refused_and_a_public_key_served(live):
    invalid_before = live.metric(API_KEY_REQUESTS + "_total", key=NO_KEY, result="invalid")
    tokens_before = live.metric(API_KEY_OUTPUT_TOKENS + "_total", key="tests")
    with pytest.raises(openai.AuthenticationError) as refused:
        client(live, "not-a-key-0123456789abcdef").chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2
        )
    assert refused.value.status_code == 401
    assert refused.value.response.headers["www-authenticate"].startswith("Bearer")
    assert "not-a-key" not in refused.value.response.text
    missing = live.http.post(
        CHAT, json={"model": MODEL, "messages": HI}, headers={"authorization": ""}
    )
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    raw = client(live, PUBLIC_KEY).chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=3
    )
    assert raw.parse().choices[0].message.content is not None
    assert headers.ARM not in raw.headers  # named to admin keys only (routing.arm_header)
    assert [m.id for m in client(live, PUBLIC_KEY).models.list().data] == [MODEL]
    live.wait_for_metric(
        API_KEY_REQUESTS + "_total", invalid_before + 1, key=NO_KEY, result="invalid"
    )
    live.wait_for_metric(API_KEY_OUTPUT_TOKENS + "_total", tokens_before + 1, key="tests")


def test_forcing_an_arm_needs_an_admin_key(live):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    forced = live.http.post(CHAT, json=body, headers={**PUBLIC, headers.ARM_OVERRIDE: "ngram"})
    assert forced.status_code == 403
    assert forced.json()["error"]["code"] == "admin_key_required"
    reply = client(live, ADMIN_KEY).chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=2, extra_headers={headers.ARM_OVERRIDE: "ngram"}
    )
    assert reply.headers[headers.ARM] == "ngram"


def test_headers_a_client_sends_are_passed_on_only_where_safe(live):
    """One smoke case each (the cases: tests/unit/test_dispatch.py, test_dispatch_contract.py):
    headers that steer Ray Serve, each of which, sent by a client, once made the arm fail or
    changed how Ray Serve routes; and a request id, kept only in the expected shape."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 1}
    steering = {
        "x-request-disconnect-disabled": "?1",
        "x-request-timeout-seconds": "0.001",
        "serve-multiplexed-model-id": "other-model",
    }
    response = live.http.post(CHAT, json=body, headers=steering)
    assert response.status_code == 200, response.text
    kept = live.http.post(CHAT, json=body, headers={headers.REQUEST_ID: "trace:42.a_b-c"})
    assert kept.headers[headers.REQUEST_ID] == "trace:42.a_b-c"
    odd = live.http.post(CHAT, json=body, headers={headers.REQUEST_ID: "x" * 200})
    assert odd.status_code == 200 and odd.headers[headers.REQUEST_ID] != "x" * 200


def test_a_key_added_to_the_file_works_and_a_removed_one_stops(live):
    keys_file = live.config_path.parent / "api-keys"
    original = keys_file.read_text()
    new_key = uuid.uuid4().hex
    body = {"model": MODEL, "messages": HI, "max_tokens": 1}

    def status(key: str) -> int:
        auth = {"authorization": f"Bearer {key}"}
        return live.http.post(CHAT, json=body, headers=auth).status_code

    try:
        keys_file.write_text(f"rotated={new_key}\n")  # the old public key is gone
        deadline = time.monotonic() + 20
        while status(new_key) != 200:
            assert time.monotonic() < deadline, "the new key was not taken"
            time.sleep(0.25)
        assert status(PUBLIC_KEY) == 401
    finally:
        keys_file.write_text(original)
    deadline = time.monotonic() + 20
    while status(PUBLIC_KEY) != 200:
        assert time.monotonic() < deadline, "the restored key was not taken"
        time.sleep(0.25)


JOIN = textwrap.dedent(
    """
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
    except Exception as exc:
        print(type(exc).__name__, str(exc)[:300])
        sys.exit(3)
    print("joined")
    """
)


def test_the_local_ray_cluster_refuses_a_client_without_its_token(live):
    """`specserve serve`'s cluster listens on the node's address: a process that reaches its
    GCS with another token is refused (deploy.check_ray_token), and the token file is private."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex * 2}
    done = subprocess.run(
        [sys.executable, "-c", JOIN, gcs], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, (done.stdout, done.stderr[-2000:])
    assert "joined" not in done.stdout
    assert RAY_TOKEN_FILE.stat().st_mode & 0o077 == 0
