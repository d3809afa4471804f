"""An engine-level change redeploys only the arm it touches: the platform hands Ray Serve the
whole Serve config and Ray Serve finds the one application that changed, and the other arms
serve on without dropping a request. Runs last: it restarts an engine."""

import contextlib
import threading
import time

import pytest
import ray

from specserve import headers
from specserve.config import load_config
from tests.conftest import MODEL, render_config

pytestmark = pytest.mark.slow


def replica_actors(app: str) -> set[str]:
    """Names of the live replica actors of an app; a new replica gets a new name."""
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    }


@contextlib.contextmanager
def steady_traffic(live, arm: str):
    """Requests to `arm`, one after another, while the block runs; yields their statuses."""
    statuses: list[int] = []
    stop = threading.Event()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def send() -> None:
        while not stop.is_set():
            r = live.http.post(
                "/v1/chat/completions", json=body, headers={headers.ARM_OVERRIDE: arm}
            )
            statuses.append(r.status_code)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        yield statuses
    finally:
        stop.set()
        sender.join()


def test_changing_k_redeploys_only_that_arm(live, restore_config):
    no_spec_before = replica_actors("arm-no-spec")
    ngram_before = replica_actors("arm-ngram")
    assert no_spec_before and ngram_before

    with steady_traffic(live, "no-spec") as statuses:
        live.write_config(render_config(k=2))
        live.platform.deploy(load_config(live.config_path))
        live.platform.wait_until_running(timeout_s=300)
    print(f"no-spec served {len(statuses)} requests while ngram redeployed")
    assert len(statuses) >= 5 and set(statuses) == {200}  # none dropped on the other arm

    assert replica_actors("arm-no-spec") == no_spec_before
    assert replica_actors("arm-ngram").isdisjoint(ngram_before)
    deadline = time.monotonic() + 120
    while True:
        r = live.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "a b a b a b"}],
                "max_tokens": 8,
            },
            headers={headers.ARM_OVERRIDE: "ngram"},
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert r.status_code == 200, r.text
    assert r.json()["metrics"]["speculative_decoding"]["num_spec_tokens"] == 2
    # Put k back for anything that runs after.
    live.write_config(render_config())
    live.platform.deploy(load_config(live.config_path))
    live.platform.wait_until_running(timeout_s=300)
