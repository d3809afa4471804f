"""The release upgraded as Helm 4 and KubeRay upgrade it (release.py; harness.py `sync` and
`roll`): `helm upgrade` and `helm rollback` after `specserve config apply` under upgrade strategy
None, and an upgrade that changes the cluster spec under NewCluster, rolled to a new cluster
under load."""

from __future__ import annotations

import time

import helm_python
import pytest
import yaml

from specserve.config.schema import revision_of
from specserve.config.serve_config import ROUTER_APP_NAME
from tests.cluster import kuberay
from tests.cluster.load import replica_ids, streaming_load
from tests.deploy.conftest import generate
from tests.deploy.kube_standin import ApiError

# In `make test`: both took 13 minutes on two cores without bf16 (BENCHMARKS.md, "Upgrades").
pytestmark = pytest.mark.e2e

CONFIG_APPLY_FIELDS = {".data.config.yaml", ".metadata.annotations.specserve.io/revision"}


def serving_revision(cluster) -> set[str]:
    """The config revision every pod of the API Service routes with now."""
    return {cluster.request(pod, stream=False)["revision"] for pod in cluster.wait_serving(1)}


def until_serving_revision(cluster, revision: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while serving_revision(cluster) != {revision}:
        assert time.monotonic() < deadline, f"the pods do not route with {revision}"
        time.sleep(2)


def conflicts(error: ApiError) -> set[str]:
    return {cause["field"] for cause in error.status()["details"]["causes"]}


def new_image(release) -> dict:
    """Values as the release's now with an image tag it never had: a new cluster spec."""
    return generate._merge(release.values, {"image": {"tag": f"0.{release.revision + 1}.0-cpu"}})


def engines(cluster) -> dict[str, set[str]]:
    apps = cluster.operator.applications()
    return {name: replica_ids(apps, name) for name in apps if name != ROUTER_APP_NAME}


def queue_bound(cluster, app: str) -> int | None:
    """The application's max_queued_requests in force; None while Ray Serve updates it."""
    deployments = list(cluster.operator.applications()[app]["deployments"].values())
    return deployments[0]["deployment_config"]["max_queued_requests"] if deployments else None


def until_redeployed(cluster, app: str, before: set[str]) -> None:
    """Until none of `before`, the application's replicas, runs and the application runs."""
    deadline = time.monotonic() + kuberay.REDEPLOY_TIMEOUT_S
    while replica_ids(cluster.operator.applications(), app) & before:
        assert time.monotonic() < deadline, f"{app} was not redeployed"
        time.sleep(2)
    cluster.operator.wait_running(cluster.app_names(), timeout_s=kuberay.REDEPLOY_TIMEOUT_S)


def serve_as_the_api_says(cluster) -> None:
    """An earlier test may have changed the Serve config directly, behind the RayService (as
    `kubectl exec ... serve deploy` would): put back what the API holds, as the next change of
    the RayService would, and wait out the arms it redeploys."""
    running = {a["name"]: a for a in cluster.serve_config_now["applications"]}
    wanted = {a["name"]: a for a in cluster.serve_config_taken["applications"]}
    changed = [name for name, app in wanted.items() if running.get(name) != app]
    if changed:
        before = {name: replica_ids(cluster.operator.applications(), name) for name in changed}
        cluster.operator.submit(cluster.serve_config_taken)
        cluster.serve_config_now = cluster.serve_config_taken
        for name in changed:
            until_redeployed(cluster, name, before[name])


def until_queue_bound(cluster, app: str, bound: int) -> None:
    deadline = time.monotonic() + kuberay.REDEPLOY_TIMEOUT_S
    while queue_bound(cluster, app) != bound:
        assert time.monotonic() < deadline, f"{app} never took max_queued_requests {bound}"
        time.sleep(2)


# Two redeploys of the router's application on two busy cores: 1-3 minutes.
@pytest.mark.timeout(420)
@pytest.mark.disruptive
def test_helm_upgrade_and_rollback_after_config_apply_keep_the_live_config_under_strategy_none(
    cluster, tmp_path, capsys
):
    release = cluster.release
    serve_as_the_api_says(cluster)
    installed_text, first = release.live_config(), release.revision
    kept = engines(cluster)  # no step of this test restarts an engine
    installed_bound = queue_bound(cluster, "arm-ngram")
    assert installed_bound is not None
    # config apply: the weights and ngram's queue bound, so the live ConfigMap and ngram's
    # application (serveConfigV2, now owned by `specserve`) change; Ray Serve applies the bound
    # to the running replicas.
    config = yaml.safe_load(installed_text)
    for arm in config["arms"]:
        arm["weight"] = 70 if arm["name"] == "no-spec" else 30
        if arm["name"] == "ngram":
            arm["max_queued_requests"] = installed_bound + 16
    applied = yaml.safe_dump(config, sort_keys=False)
    (tmp_path / "applied.yaml").write_text(applied)
    assert release.config("apply", str(tmp_path / "applied.yaml")) == 0
    assert "Ray Serve rescales arm-ngram in place" in capsys.readouterr().out
    assert cluster.sync() == ["ConfigMap files updated", "serveConfigV2 submitted in place"]
    until_queue_bound(cluster, "arm-ngram", installed_bound + 16)
    until_serving_revision(cluster, revision_of(applied.encode()))
    assert engines(cluster) == kept
    containers = {name: pod.container_pid() for name, pod in cluster.pods.items()}

    # helm upgrade to upgradeStrategy None, the values' config as installed: the chart renders
    # the live config and Serve config back; nothing conflicts, nothing changes in the cluster.
    none = generate._merge(release.values, {"ray": {"upgradeStrategy": "None"}})
    assert release.upgrade(none) == first + 1
    assert release.live_config() == applied
    assert cluster.sync() == []

    # A router setting changes serveConfigV2, which `config apply` owns: Helm 4 stops on the
    # conflict; forced, KubeRay applies the Serve config in place: the router's application
    # redeploys, the arms' engines stay, no pod restarts, the live config stays.
    polled = generate._merge(none, {"router": {"configPollSeconds": 2.0}})
    with pytest.raises(ApiError) as refused:
        release.upgrade(polled)
    assert conflicts(refused.value) == {".spec.serveConfigV2"}
    routers = replica_ids(cluster.operator.applications(), ROUTER_APP_NAME)
    assert release.upgrade(polled, force_conflicts=True) == first + 2
    assert cluster.sync() == ["serveConfigV2 submitted in place"]
    until_redeployed(cluster, ROUTER_APP_NAME, routers)
    assert engines(cluster) == kept
    until_serving_revision(cluster, revision_of(applied.encode()))

    # A new image under None: the chart refuses the upgrade (KubeRay would run the new Serve
    # config in the old pods); nothing is applied.
    with pytest.raises(helm_python.HelmRenderError, match="ray.upgradeStrategy None"):
        release.upgrade(new_image(release))
    assert release.revision == first + 2 and cluster.sync() == []

    # helm rollback to the revision before the router's change, rendered after the apply: the
    # live config kept, the router's setting back, the engines as they were.
    routers = replica_ids(cluster.operator.applications(), ROUTER_APP_NAME)
    assert release.rollback(first + 1) == first + 3
    assert release.live_config() == applied
    assert cluster.sync() == ["serveConfigV2 submitted in place"]
    until_redeployed(cluster, ROUTER_APP_NAME, routers)
    assert engines(cluster) == kept
    until_serving_revision(cluster, revision_of(applied.encode()))
    # No pod was replaced or restarted: the same pods, each with its container's first process.
    assert {name: pod.container_pid() for name, pod in cluster.pods.items()} == containers

    # helm rollback to the revision rendered before the apply would revert it: Helm stops on the
    # fields `config apply` owns. `config rollback` is the way back, and restores the chart's
    # config.
    with pytest.raises(ApiError) as refused:
        release.rollback(first)
    assert conflicts(refused.value) == CONFIG_APPLY_FIELDS
    assert release.live_config() == applied
    installed = revision_of(installed_text.encode())
    assert release.config("rollback", "--to", installed) == 0
    assert cluster.sync() == ["ConfigMap files updated", "serveConfigV2 submitted in place"]
    until_queue_bound(cluster, "arm-ngram", installed_bound)
    until_serving_revision(cluster, installed)
    assert engines(cluster) == kept
    assert not cluster.restarts(), f"kubelet would restart: {cluster.restarts()}"


# A second cluster's start beside the first, its engines loading beside the old ones' streams
# (5.6 min on two cores without bf16), the old pods' drain (1-2 min) and the load's end: 10.5
# minutes there, in all.
@pytest.mark.timeout(900)
@pytest.mark.disruptive
def test_an_upgrade_of_the_cluster_spec_rolls_a_new_cluster_under_load_and_loses_no_request(
    cluster, tmp_path
):
    release = cluster.release
    revision = serving_revision(cluster)
    old = dict(cluster.pods)
    # Under NewCluster, a new image: a new cluster spec.
    values = generate._merge(new_image(release), {"ray": {"upgradeStrategy": "NewCluster"}})
    # One client: the harness's pods share two cores, where two clusters' engines and a heavier
    # load would only slow the new engines' start.
    with streaming_load(cluster, tmp_path, clients=1) as load:
        time.sleep(10)  # streams in flight through the old cluster's pods
        release.upgrade(values)
        upgraded_at = time.time()
        done = cluster.sync(on_switch=load.route)
        switched_at = time.time()  # the old cluster deleted, too
        time.sleep(10)  # new requests through the new cluster a while on
    records = load.records()
    lost = [r for r in records if r["outcome"] != "ok"]
    during = [r for r in records if upgraded_at < r["started"] < switched_at]
    # Every pod the harness runs is now the new cluster's (Ready or not: on two starved cores a
    # worker's 2-s readiness probe may miss once, taking it out of the endpoints a while).
    new_urls = {cluster.api_url(p) for p in cluster.pods.values()}
    print(f"{done}; {len(records)} requests, {len(during)} started during the roll; lost: {lost}")
    assert len(done) == 1 and done[0].startswith("rolled to a new cluster"), done
    assert during, "no request was sent while the cluster rolled"
    assert not lost, f"requests lost to the roll: {lost}"
    # Every pod is new, with a new name and address; the new cluster serves the live config.
    assert not set(cluster.pods) & set(old)
    assert not {p.endpoint.ip for p in cluster.pods.values()} & {
        p.endpoint.ip for p in old.values()
    }
    assert records[-1]["pod_url"] in new_urls
    assert serving_revision(cluster) == revision
    assert all(app["status"] == "RUNNING" for app in cluster.operator.applications().values())
    assert not cluster.restarts(), f"kubelet would restart: {cluster.restarts()}"
