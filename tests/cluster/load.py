"""Streaming load through the API Service while a test disrupts the cluster, and the replicas
it reads to tell what was redeployed."""

from __future__ import annotations

import contextlib
import json

from tests.cluster import kuberay


class Load:
    """Clients streaming with an API key (client.py's `load`), round-robin over the pods
    `route` names: kube-proxy's part, read before every request."""

    def __init__(self, cluster, directory) -> None:
        self.cluster = cluster
        self.urls, self.stop, self.out = (directory / n for n in ("urls", "stop", "requests.jsonl"))

    def route(self, pods) -> None:
        self.urls.write_text("\n".join(self.cluster.api_url(p) for p in pods))

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines()]


@contextlib.contextmanager
def streaming_load(cluster, directory, clients: int = 3):
    """Load from `clients` clients over the API Service's endpoints while the block runs; they
    end their streams and stop after it."""
    load = Load(cluster, directory)
    load.route(cluster.wait_serving(2))
    key, model = cluster.api_key(), cluster.model()
    args = (str(load.urls), key, model, str(load.stop), str(load.out))
    processes = [cluster.client_popen("ingress", "load", *args) for _ in range(clients)]
    try:
        yield load
    finally:
        load.stop.write_text("1")
        for process in processes:
            process.wait(timeout=kuberay.LOAD_STOP_S)


def replica_ids(applications: dict, name: str) -> set[str]:
    """An application's RUNNING replicas: a changed set means it was redeployed."""
    deployments = applications[name]["deployments"].values()
    return {r["replica_id"] for d in deployments for r in d["replicas"] if r["state"] == "RUNNING"}
