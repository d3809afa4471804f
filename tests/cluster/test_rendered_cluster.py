"""The rendered chart run as a cluster runs it (harness.py): pods from the RayService, probes,
traffic with an API key, the NetworkPolicy enforced, a ConfigMap update, one arm redeployed, and
a worker pod deleted under load."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from specserve.config.serve_config import ROUTER_APP_NAME
from tests.cluster import kuberay, netpol
from tests.cluster.load import replica_ids, streaming_load
from tests.conftest import unavailable

pytestmark = pytest.mark.e2e


def test_every_pod_passes_its_rendered_and_kuberay_probes(cluster):
    for pod in cluster.pods.values():
        probes = pod.plan.probes()
        # KubeRay's, where the chart renders none: 2 s (the head's 5 s) to answer, and a
        # RayService worker's readiness checks its raylet and its Serve proxy, failing at once.
        assert probes["liveness"].timeout_s == (5 if pod.plan.head else 2), pod.plan.name
        if not pod.plan.head:
            readiness = probes["readiness"]
            assert readiness.failure_threshold == 1 and readiness.command, readiness
            assert "local_raylet_healthz" in readiness.command[-1], readiness
            assert "/-/healthz" in readiness.command[-1], readiness
        assert pod.prober.started, f"{pod.plan.name}: its startup probe has not passed"
    proxies = cluster.operator.proxy_ips()
    assert cluster.head.endpoint.ip in proxies
    assert cluster.head.prober.ready, "the head is not Ready"
    for pod in cluster.workers():
        if pod.endpoint.ip in proxies:  # kubelet probes readiness every 5 s
            cluster.wait_until(lambda p=pod: p.prober.ready, f"{pod.plan.name} Ready", 60)
        else:  # a worker with no replica runs no proxy: not an endpoint of the API Service
            assert not pod.prober.ready, f"{pod.plan.name} is Ready without a Serve proxy"
    assert not cluster.restarts(), f"kubelet would restart: {cluster.restarts()}"


def test_the_api_serves_plain_and_streamed_requests_with_a_key_through_every_pod(cluster):
    # The engines' pods serve (a worker's readiness fails at its first slow probe: it may be
    # out of the endpoints for a probe period on a busy machine, as on a cluster).
    serving = cluster.wait_serving(2)
    # The chart leaves the head out of the API Service (excludeHeadPodFromServeSvc).
    assert cluster.head not in serving
    for index, pod in enumerate(serving):
        answer = cluster.request(pod, stream=index % 2 == 1)
        assert answer["status"] == 200 and answer["text"].strip(), answer
        assert answer["arm"] in cluster.arm_names() and answer["revision"], answer
    assert cluster.curl("ingress", f"http://{serving[0].endpoint.ip}:8000/v1/models") == 401


def test_the_network_policy_lets_through_what_is_needed_and_nothing_else(cluster):
    head, *workers = cluster.pods.values()
    # A worker with a replica: one without runs no proxy, so its API port would refuse any client
    # and the drops below would prove nothing.
    proxies = cluster.operator.proxy_ips()
    worker = next((w for w in workers if w.endpoint.ip in proxies), None)
    assert worker, f"no worker runs a Serve proxy: {proxies}"
    dashboard = f"http://{head.endpoint.ip}:{kuberay.DASHBOARD_PORT}"
    api = f"http://{worker.endpoint.ip}:{kuberay.SERVE_PORT}/v1/models"
    metrics = f"http://{worker.endpoint.ip}:{kuberay.METRICS_PORT}/metrics"
    # What Ray, the API, KubeRay and Prometheus need (Ray itself: the cluster runs at all). A
    # proxy's first request waits for its dispatch's first read of what runs (seconds on a busy
    # machine): what passes is given time to answer, what is dropped is not.
    reached_s = 30
    assert cluster.curl("operator", f"{dashboard}/api/version", reached_s) != 0
    assert cluster.curl("ingress", api, reached_s) == 401  # reached; the key is checked
    assert cluster.curl("prometheus", metrics, reached_s) == 200
    # Everything else is dropped: no connection at all within the timeout.
    refused = {
        "the job API from an API client": ("ingress", f"{dashboard}/api/jobs/"),
        "the job API from another namespace": ("outsider", f"{dashboard}/api/jobs/"),
        "the API from another namespace": ("outsider", api),
        "the metrics from another namespace": ("outsider", metrics),
        "the API from Prometheus": ("prometheus", api),
        "the GCS from the operator": ("operator", f"http://{head.endpoint.ip}:{kuberay.GCS_PORT}/"),
    }
    codes = {why: cluster.curl(client, url) for why, (client, url) in refused.items()}
    reached = {why: code for why, code in codes.items() if code != 0}
    assert not reached, f"the NetworkPolicy let through: {reached}"
    # The rules refuse them, not the network: without the head's, the outsider reaches its API.
    head.endpoint.run("nft", "delete", "table", "inet", netpol.TABLE)
    try:
        assert cluster.curl("outsider", f"{dashboard}/api/version") != 0
    finally:
        head.endpoint.run("nft", "-f", "-", input=cluster.rulesets[head.plan.name])
    assert cluster.curl("outsider", f"{dashboard}/api/version") == 0
    # Egress: a pod reaches no address outside the release but DNS.
    outsider = cluster.clients["outsider"]
    server = outsider_server(cluster)
    try:
        done = worker.exec(
            ["curl", "-s", "-o", "/dev/null", "-m", "3", f"http://{outsider.ip}:8081/"]
        )
        assert done.returncode == 28, f"a pod reached the outsider: exit {done.returncode}"
        # The outsider's server works: another client namespace reaches it.
        assert cluster.curl("ingress", f"http://{outsider.ip}:8081/") == 200
    finally:
        server.kill()


def outsider_server(cluster):
    import subprocess
    import sys

    argv = [
        "ip",
        "netns",
        "exec",
        cluster.clients["outsider"].netns,
        sys.executable,
        "-m",
        "http.server",
        "8081",
        "--bind",
        "0.0.0.0",
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    deadline = time.monotonic() + 20
    while cluster.curl("ingress", f"http://{cluster.clients['outsider'].ip}:8081/") != 200:
        assert time.monotonic() < deadline, "the outsider's server did not start"
        time.sleep(0.5)
    return server


def test_a_config_map_update_is_followed_by_every_pod_without_a_restart(cluster):
    name, files = cluster.router_config()
    config = yaml.safe_load(files["config.yaml"])
    only = config["arms"][0]["name"]
    changed = {
        **config,
        "arms": [{**a, "weight": 100 if a["name"] == only else 0} for a in config["arms"]],
    }
    pids = {n: [p.pid for p in pod.processes()] for n, pod in cluster.pods.items()}
    try:
        cluster.update_config_map(name, {"config.yaml": yaml.safe_dump(changed, sort_keys=False)})
        deadline = time.monotonic() + 90
        for pod in cluster.serving_pods():
            while True:
                answer = cluster.request(pod, stream=False)
                if answer["arm"] == only and answer["revision"] != cluster.first_revision:
                    break
                assert time.monotonic() < deadline, f"{pod.plan.name} still routes with {answer}"
                time.sleep(2)
    finally:
        cluster.update_config_map(name, files)
    assert {n: [p.pid for p in pod.processes()] for n, pod in cluster.pods.items()} == pids


@pytest.mark.disruptive
def test_patching_one_arm_in_serve_config_redeploys_that_arm_only(cluster):
    before = cluster.operator.applications()
    document = cluster.current_serve_config()
    patched_arm = document["applications"][-1]
    engine = patched_arm["args"]["arm"].setdefault("engine", {})
    engine["max_num_seqs"] = 8 if engine.get("max_num_seqs") != 8 else 16
    cluster.operator.submit(document)
    cluster.serve_config_now = document
    deadline = time.monotonic() + kuberay.REDEPLOY_TIMEOUT_S
    while True:  # Ray Serve takes the new config, then the arm's new replica runs
        after = cluster.operator.applications()
        changed = replica_ids(after, patched_arm["name"]) - replica_ids(before, patched_arm["name"])
        if changed and after[patched_arm["name"]]["status"] == "RUNNING":
            break
        assert time.monotonic() < deadline, f"{patched_arm['name']} was not redeployed"
        time.sleep(3)
    for name in cluster.app_names() - {patched_arm["name"]}:
        assert replica_ids(after, name) == replica_ids(before, name), f"{name} was redeployed"
    answer = cluster.request(cluster.wait_serving(1)[0], stream=True)
    assert answer["status"] == 200


# The pod's drain (up to its grace period), its arms' new engines elsewhere and the load's end:
# 273 s on two cores without bf16.
@pytest.mark.timeout(600)
@pytest.mark.disruptive
def test_deleting_a_worker_pod_under_load_loses_no_started_request(cluster, tmp_path):
    victim = cluster.busiest_worker()
    moved = cluster.apps_on(victim)
    with streaming_load(cluster, tmp_path) as load:
        time.sleep(15)  # streams in flight through every pod, on every engine
        load.route([p for p in cluster.wait_serving(2) if p is not victim])  # endpoints first
        deleted_at = time.time()
        took = cluster.delete(victim)
        # New requests once the pod is gone, until its arms run again elsewhere, and a while on.
        deadline = time.monotonic() + kuberay.REDEPLOY_TIMEOUT_S
        while not all(a["status"] == "RUNNING" for a in cluster.operator.applications().values()):
            assert time.monotonic() < deadline, "the deleted pod's arms did not run again"
            time.sleep(3)
        time.sleep(10)
    records = load.records()
    running_at_delete = [r for r in records if r["started"] < deleted_at < r["ended"]]
    lost = [r for r in records if r["outcome"] != "ok"]
    print(
        f"deleted {victim.plan.name} (ran {sorted(moved)}): {took}; {len(records)} requests, "
        f"{len(running_at_delete)} running when it was deleted, "
        f"{len([r for r in records if r['started'] > deleted_at])} sent after; lost: {lost}"
    )
    # New requests go to the other pods: the deleted one left the Service's endpoints first.
    after_delete = [r for r in records if r["started"] > deleted_at]
    assert all(r["pod_url"] != cluster.api_url(victim) for r in after_delete)
    assert running_at_delete, "no request was running when the pod was deleted"
    assert after_delete, "no request was sent after the pod's deletion began"
    assert not lost, f"requests lost to the deletion: {lost}"
    assert took.get("pre_stop_s", 0) < victim.plan.grace_s
    # Its replicas run on other pods now.
    assert not cluster.apps_on(victim), "replicas are still placed on the deleted pod"
    after = cluster.operator.applications()
    assert all(after[app]["status"] == "RUNNING" for app in moved)
    # KubeRay replaces the deleted pod: a new name, a new address, and it joins the cluster.
    fresh = cluster.recreate(victim.plan.group)
    assert fresh.plan.name != victim.plan.name and fresh.endpoint.ip != victim.endpoint.ip
    assert cluster.wait_until(lambda: ray_node_alive(cluster, fresh.endpoint.ip), "joined", 60)
    assert not cluster.restarts(), f"kubelet would restart: {cluster.restarts()}"


def ray_node_alive(cluster, ip: str) -> bool:
    """Whether Ray's GCS lists a live node at this address."""
    return (ip, "ALIVE") in cluster.operator.nodes()


# The head's drain and deletion (~40-80 s), the new head's start (~80-130 s), the applications'
# recovery (~30-45 s) and the load's end: 4-5 minutes on two busy cores. Ray Serve's recovering
# controller killed the busy engines' replicas that had not answered within its 30 s (they
# answered after 31-32 s): the chart gives them 120 s (RAY_SERVE_SLOW_STARTUP_WARNING_S).
@pytest.mark.timeout(600)
@pytest.mark.disruptive
def test_deleting_the_head_pod_under_load_with_gcs_fault_tolerance_loses_no_request(
    cluster, tmp_path
):
    assert cluster.gcs_ft, "the harness runs the chart with GCS fault tolerance on"
    arms = {a: replica_ids(cluster.operator.applications(), a) for a in cluster.app_names()}
    arms = {a: ids for a, ids in arms.items() if a != ROUTER_APP_NAME}  # the engines
    old = cluster.head
    with streaming_load(cluster, tmp_path) as load:
        time.sleep(15)  # streams in flight through the workers' proxies
        deleted_at = time.time()
        took = cluster.delete(old)
        head = cluster.recreate("head")  # KubeRay creates the head again
        cluster.wait_until(lambda: head.prober.ready, f"{head.plan.name} Ready")
        ready_at = time.time()
        resubmitted = cluster.operator.reconcile(
            cluster.serve_config_now, timeout_s=kuberay.REDEPLOY_TIMEOUT_S
        )
        cluster.operator.wait_running(cluster.app_names(), timeout_s=kuberay.REDEPLOY_TIMEOUT_S)
        running_at = time.time()
        time.sleep(10)  # and new requests a while on
    records = load.records()
    lost = [r for r in records if r["outcome"] != "ok"]
    headless = [r for r in records if deleted_at < r["started"] < ready_at]
    print(
        f"head {old.plan.name} deleted ({took}); {head.plan.name} Ready after "
        f"{ready_at - deleted_at:.0f} s, every application RUNNING after "
        f"{running_at - deleted_at:.0f} s (Serve config submitted again: {resubmitted}); "
        f"{len(records)} requests, {len(headless)} started while no head was Ready; lost: {lost}; "
        f"containers started again: {cluster.exits()}"
    )
    assert head.plan.name != old.plan.name and head.endpoint.ip != old.endpoint.ip
    assert headless, "no request was sent while the head was away"
    assert not lost, f"requests lost to the head's deletion: {lost}"
    # The arms' engines kept running through it: the same replicas, none started again.
    after = cluster.operator.applications()
    assert {a: replica_ids(after, a) for a in arms} == arms
    assert all(ray_node_alive(cluster, w.endpoint.ip) for w in cluster.workers())
    assert not cluster.restarts(), f"kubelet would restart: {cluster.restarts()}"


def test_a_real_prometheus_in_the_monitoring_namespace_scrapes_every_pod(cluster, tmp_path):
    import shutil
    import subprocess

    if shutil.which("prometheus") is None:
        unavailable("Debian's prometheus is not installed")
    targets = [f"{p.endpoint.ip}:{kuberay.METRICS_PORT}" for p in cluster.pods.values()]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 2s}\n"
        f"scrape_configs:\n  - job_name: pods\n    static_configs: [{{targets: {targets}}}]\n"
    )
    (tmp_path / "data").mkdir()
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.clients["prometheus"].netns, "prometheus",
         f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         "--web.listen-address=127.0.0.1:9090"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline, up = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            up = query(cluster, "up")
            if len(up) == len(targets) and all(v == 1 for v in up.values()):
                break
            time.sleep(2)
        assert up == dict.fromkeys(targets, 1.0), f"Prometheus's view of the pods: {up}"
        # The router's and the engines' series arrive through the same ports.
        assert query(cluster, "ray_specserve_requests_total"), "no router metrics scraped"
    finally:
        server.kill()
        server.wait(timeout=10)


def query(cluster, expression: str) -> dict[str, float]:
    """{instance: value} of an instant query to the Prometheus in the monitoring namespace."""
    done = cluster.clients["prometheus"].run(
        "curl", "-s", "-m", "5", "--data-urlencode", f"query={expression}",
        "http://127.0.0.1:9090/api/v1/query",
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout:
        return {}
    result = json.loads(done.stdout).get("data", {}).get("result", [])
    return {r["metric"].get("instance", ""): float(r["value"][1]) for r in result}
