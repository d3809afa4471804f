"""Drain one Ray node before its pod stops: `specserve drain-node`, the chart's `preStop`.

Kubernetes runs the preStop hook when a pod is deleted (an upgrade, a scale-down, a drained
Kubernetes node), and sends SIGTERM only when it returns. Without it, the requests in flight
through the pod's HTTP proxy, and those its engines are generating, end with the pod. With it:

1. The node is marked draining in Ray's GCS key-value store: the dispatch in this node's HTTP
   proxy refuses new requests (503 with Retry-After, so clients retry through another pod) while
   those it holds finish (router/arm_states.py reads the mark).
2. A worker node is also drained in Ray itself (reason: preemption, with the pod's deadline): Ray
   schedules nothing new there, and Ray Serve starts a replacement of each replica on the node
   elsewhere and stops the old one, gracefully: an arm's replica finishes the requests it holds
   (engine/arm.py's graceful shutdown). The head is never drained in Ray: its deletion ends the
   cluster, and a drained head stops scheduling the Serve controller's work.
3. The command waits until no Serve replica is left on the node (Ray Serve stops each once its
   replacement runs and its own requests have finished, within the arm's graceful shutdown) and
   the requests through this node's HTTP proxy are done (the router's in-flight gauge on this
   node's metrics export port, one report interval behind, read twice in a row at zero); or
   until the deadline. The engines' own gauges are no guide: requests keep arriving at a
   replica until its replacement runs.
4. Unless every other alive node carries the drain mark too: the whole cluster is being deleted
   (a NewCluster upgrade deletes the old cluster; a scale to zero), so the replicas have nowhere
   to go, and Ray Serve would keep them until the deadline. Every proxy then refuses new
   requests, so the command waits instead for the requests the node's replicas hold (Ray Serve's
   processing gauge) and those through its proxy, and lets the pod stop. The head then waits
   for the other nodes to stop before it does: their raylets need its GCS.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from specserve.metrics import EXPORT_PREFIX, REQUESTS_IN_FLIGHT, scrape

logger = logging.getLogger(__name__)

# Where the dispatch of each proxy looks for its node's drain mark (Ray's GCS key-value store).
DRAIN_KV_NAMESPACE = "specserve"
DRAIN_KV_PREFIX = "draining/"
# Ray's metrics export port on every pod (KubeRay's default `metrics-export-port`).
METRICS_PORT = 8080
# Requests in flight through a node's HTTP proxy, as the dispatch there exports them.
IN_FLIGHT_SERIES = EXPORT_PREFIX + REQUESTS_IN_FLIGHT
# Requests a Serve replica is processing, as Ray Serve exports them (on the replica's node).
REPLICA_REQUESTS_SERIES = EXPORT_PREFIX + "serve_replica_processing_queries"
# Ray Serve names each replica's actor class after this prefix.
REPLICA_CLASS_PREFIX = "ServeReplica:"
POLL_S = 1.0
# Ray's default interval between metrics reports (RAY_metrics_report_interval_ms).
DEFAULT_REPORT_INTERVAL_S = 10.0


def drain_key(node_id: str) -> bytes:
    return (DRAIN_KV_PREFIX + node_id).encode()


@dataclass(frozen=True)
class DrainResult:
    node_id: str
    head: bool
    drained_in_ray: bool
    # Serve replicas Ray Serve could still move when the wait ended (0 also once the node was
    # stranded: every other node draining too, its replicas staying till the pod stops)
    replicas_left: int
    stranded: bool
    in_flight: float | None  # at the end; None: the metrics port could not be read
    waited_s: float


def requests_on_node(metrics_url: str, *, in_replicas: bool = False) -> float | None:
    """Requests in flight through this node's proxy (and, `in_replicas`, those its Serve
    replicas process), as its metrics export shows them; None if unreadable."""
    series = {IN_FLIGHT_SERIES, REPLICA_REQUESTS_SERIES} if in_replicas else {IN_FLIGHT_SERIES}
    try:
        samples = scrape(metrics_url, timeout_s=2)
        return sum(s.value for _, s in samples if s.name in series)
    except httpx.HTTPError:
        return None


def other_nodes(node_id: str) -> list[str]:
    """The cluster's other alive nodes (Ray's GCS)."""
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != node_id]


def nowhere_to_move(node_id: str) -> bool:
    """Whether every other alive node carries the drain mark (the whole cluster is going); False
    when that cannot be read."""
    from ray.experimental import internal_kv

    try:
        others = other_nodes(node_id)
        return all(
            internal_kv._internal_kv_exists(drain_key(other), namespace=DRAIN_KV_NAMESPACE)
            for other in others
        )
    except Exception:  # the GCS is unreachable: wait as for a lone node
        logger.exception("cannot read which nodes are draining")
        return False


def movable_replicas(node_id: str) -> int | None:
    """Serve replicas on the node that Ray Serve can still move elsewhere: none once every
    other node drains too."""
    return 0 if nowhere_to_move(node_id) else replicas_on(node_id)


def replicas_on(node_id: str) -> int | None:
    """Serve replicas alive on a node (Ray's state API); None if it cannot be read."""
    from ray.util.state import list_actors

    try:
        alive = list_actors(
            filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")],
            limit=10_000,
            raise_on_missing_output=False,
        )
    except Exception:  # the head's dashboard is unreachable: a preStop must still end
        logger.exception("cannot list the actors on node %s", node_id)
        return None
    return sum(1 for actor in alive if actor.class_name.startswith(REPLICA_CLASS_PREFIX))


def report_interval_s() -> float:
    interval_ms = os.environ.get("RAY_metrics_report_interval_ms")  # noqa: SIM112  # Ray's name
    return float(interval_ms) / 1000 if interval_ms else DEFAULT_REPORT_INTERVAL_S


def wait_for_zero(
    read: Callable[[], float | None], what: str, *, deadline: float, settle_s: float = 0.0
) -> float | None:
    """Wait `settle_s` (a metric's lag), then until `read` gives 0 twice in a row or the
    deadline passes; the last reading."""
    time.sleep(max(0.0, min(settle_s, deadline - time.monotonic())))
    last, zeros = read(), 0
    while time.monotonic() < deadline:
        zeros = zeros + 1 if last == 0 else 0
        if zeros >= 2:
            break
        if last is None:  # nothing answers on the node any more: its Ray has stopped
            logger.warning("cannot read the %s on this node; not waiting for them", what)
            break
        logger.info("waiting for %s %s on this node", last, what)
        time.sleep(POLL_S)
        last = read()
    return last


def drain_node(within_s: float, *, metrics_port: int = METRICS_PORT) -> DrainResult:
    """Drain the Ray node this process runs on (RAY_ADDRESS names the cluster, as KubeRay sets
    it in every pod) and wait for its requests, for at most `within_s` seconds."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.experimental import internal_kv

    started = time.monotonic()
    deadline = started + within_s
    deadline_ms = int((time.time() + within_s) * 1000)
    ray.init(logging_level=logging.WARNING, log_to_driver=False)
    try:
        node_id = ray.get_runtime_context().get_node_id()
        head = any(n["NodeID"] == node_id and n["Alive"] and _is_head(n) for n in ray.nodes())
        internal_kv._internal_kv_put(
            drain_key(node_id), str(deadline_ms).encode(), namespace=DRAIN_KV_NAMESPACE
        )
        drained_in_ray = False
        if not head:
            # What `ray drain-node` calls: Ray's private GCS client (versions.py pins Ray).
            gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
            reasons = autoscaler_pb2.DrainNodeReason  # type: ignore[attr-defined]
            preemption = reasons.Value("DRAIN_NODE_REASON_PREEMPTION")
            accepted, why = gcs.drain_node(
                node_id, preemption, "the pod is being deleted (preStop)", deadline_ms
            )
            drained_in_ray = bool(accepted)
            if not accepted:
                logger.warning("Ray refused to drain node %s: %s", node_id, why)
        logger.info(
            "node %s (%s) draining; waiting up to %.0f s for its requests",
            node_id,
            "head" if head else "worker",
            within_s,
        )
        stranded = False  # replicas left here with nowhere to go: wait for their requests
        replicas = 0
        if drained_in_ray:
            left = wait_for_zero(
                lambda: movable_replicas(node_id), "Serve replica(s)", deadline=deadline
            )
            replicas = int(left or 0)
            stranded = nowhere_to_move(node_id)
            if stranded:
                logger.info("every other node drains too: waiting for this node's requests")
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        last = wait_for_zero(
            lambda: requests_on_node(url, in_replicas=stranded),
            "request(s) in flight on the node" if stranded else "request(s) through the proxy",
            deadline=deadline,
            settle_s=report_interval_s() + POLL_S,
        )
        if head and nowhere_to_move(node_id):
            # The whole cluster is going: the head goes last, as the workers' raylets give up a
            # minute after the GCS does, ending the requests they still hold.
            stranded = True
            logger.info("every other node drains too: waiting for them to stop")
            wait_for_zero(
                lambda: len(other_nodes(node_id)), "other node(s) draining", deadline=deadline
            )
    finally:
        ray.shutdown()
    waited = time.monotonic() - started
    # Not counted again here: a head that drained first may be gone, and with it Ray's state API.
    return DrainResult(node_id, head, drained_in_ray, replicas, stranded, last, waited)


def _is_head(node: dict) -> bool:
    return any(r.startswith("node:__internal_head__") for r in node.get("Resources", {}))
