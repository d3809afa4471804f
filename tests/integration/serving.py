"""Watching an arm serve while its replicas change: which replica actors run, and whether
steady traffic is answered throughout."""

import contextlib
import threading

import ray

from specserve import headers
from tests.conftest import MODEL


def replica_actors(app: str) -> set[str]:
    """Names of the live replica actors of an app; a new replica gets a new name."""
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    }


@contextlib.contextmanager
def steady_traffic(live, arm: str, pause_s: float = 0.2):
    """Requests to `arm`, one after another, while the block runs; yields their statuses. The
    pause leaves CPU to the engines starting meanwhile on the same cores."""
    statuses: list[int] = []
    stop = threading.Event()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def send() -> None:
        while not stop.is_set():
            r = live.http.post(
                "/v1/chat/completions", json=body, headers={headers.ARM_OVERRIDE: arm}
            )
            statuses.append(r.status_code)
            stop.wait(pause_s)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        yield statuses
    finally:
        stop.set()
        sender.join()
