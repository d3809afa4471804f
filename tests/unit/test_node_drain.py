"""The preStop's wait (node_drain.wait_for_zero): done at two zeros in a row, at once when nothing
can be read any more, and at the deadline otherwise; what it waits for once the whole cluster
drains (a real Ray cluster's key-value store, a real metrics export)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from specserve import node_drain
from tests.conftest import free_port, own_ray_cluster


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(node_drain, "POLL_S", 0.01)


def readings(*values):
    remaining = list(values)
    return lambda: remaining.pop(0) if len(remaining) > 1 else remaining[0]


def test_it_waits_for_two_zeros_in_a_row():
    read = readings(2, 0, 1, 0, 0, 5)  # a lone zero is a gap between requests, not the end
    assert node_drain.wait_for_zero(read, "requests", deadline=time.monotonic() + 5) == 0


def test_it_stops_waiting_when_the_node_no_longer_answers():
    started = time.monotonic()
    assert node_drain.wait_for_zero(readings(1, None), "requests", deadline=started + 5) is None
    assert time.monotonic() - started < 1


def test_it_gives_up_at_the_deadline():
    started = time.monotonic()
    assert node_drain.wait_for_zero(readings(3), "requests", deadline=started + 0.2) == 3
    assert 0.2 <= time.monotonic() - started < 1


@pytest.mark.own_cluster
def test_replicas_have_nowhere_to_move_once_every_other_node_carries_the_drain_mark(monkeypatch):
    import ray
    from ray.experimental import internal_kv

    # A namespace of the test's own: no router anywhere reads these marks.
    monkeypatch.setattr(node_drain, "DRAIN_KV_NAMESPACE", "specserve-test-drain")
    with own_ray_cluster(num_cpus=1, include_dashboard=False):
        this_node = ray.get_runtime_context().get_node_id()
        # The node asking is a worker that has left the list; the one alive node is the other.
        leaving = "0" * len(this_node)
        assert node_drain.other_nodes(leaving) == [this_node]
        assert node_drain.other_nodes(this_node) == []  # a head left alone stops waiting
        assert not node_drain.nowhere_to_move(leaving)
        internal_kv._internal_kv_put(
            node_drain.drain_key(this_node), b"0", namespace=node_drain.DRAIN_KV_NAMESPACE
        )
        assert node_drain.nowhere_to_move(leaving)
        assert node_drain.movable_replicas(leaving) == 0


def test_a_stranded_node_also_waits_for_the_requests_its_replicas_hold():
    registry = CollectorRegistry()
    through_proxy = Gauge(node_drain.IN_FLIGHT_SERIES, "proxy", registry=registry)
    in_replicas = Gauge(
        node_drain.REPLICA_REQUESTS_SERIES, "replicas", ["replica"], registry=registry
    )
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        in_replicas.labels("a").set(2)
        in_replicas.labels("b").set(1)
        assert node_drain.requests_on_node(url) == 0
        assert node_drain.requests_on_node(url, in_replicas=True) == 3
        through_proxy.set(1)
        assert node_drain.requests_on_node(url) == 1
        assert node_drain.requests_on_node(url, in_replicas=True) == 4
    finally:
        server.shutdown()
        thread.join()
    assert node_drain.requests_on_node(url) is None  # nothing answers: the node's Ray stopped
