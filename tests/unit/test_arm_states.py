"""Which arms the router may route to, read from a real Ray Serve: running, starting, and
redeploying with the old replica still serving."""

import os
import threading
import time

import pytest
import ray
from ray import serve
from ray.serve.api import RunTarget

from specserve.readiness import routable as _routable
from specserve.readiness import state as _state
from specserve.router.arm_states import serve_applications as _serve_applications
from tests.conftest import own_ray_cluster

pytestmark = pytest.mark.own_cluster

RELEASE = "release"  # named actor whose flag lets a blocked replica constructor finish


@ray.remote
class Gate:
    def __init__(self) -> None:
        self.open = False

    def release(self) -> None:
        self.open = True

    def is_open(self) -> bool:
        return self.open


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class Engine:
    def __init__(self, version: str, block: bool) -> None:
        gate = ray.get_actor(RELEASE)
        while block and not ray.get(gate.is_open.remote()):
            time.sleep(0.1)
        self.version = version

    def __call__(self) -> str:
        return self.version


@pytest.fixture(scope="module")
def serve_instance():
    with own_ray_cluster(num_cpus=2, include_dashboard=False):
        gate = Gate.options(name=RELEASE).remote()  # type: ignore[attr-defined]
        try:
            yield gate
        finally:
            ray.get(gate.release.remote())
            serve.shutdown()


def _apps_when(condition, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        apps = _serve_applications()
        if condition(apps) or time.monotonic() > deadline:
            return apps
        time.sleep(0.2)


def test_running_starting_and_redeploying_arms(serve_instance):
    serve.run(Engine.bind("v1", False), name="arm-a", route_prefix=None)
    # A new arm whose only replica is still starting takes no traffic.
    serve.run_many(
        [RunTarget(Engine.bind("v1", True), name="arm-b", route_prefix=None)],
        wait_for_applications_running=False,
    )
    # A new version of a running arm: DEPLOYING while an old replica still serves (Serve
    # replaces one of the two at a time, and the new one cannot start).
    redeploy = threading.Thread(
        target=serve.run_many,
        args=([RunTarget(Engine.bind("v2", True), name="arm-a", route_prefix=None)],),
        kwargs={"wait_for_applications_running": False},
    )
    redeploy.start()
    apps = _apps_when(
        lambda a: _state(a.get("arm-a", {}).get("status")) == "DEPLOYING" and "arm-b" in a
    )
    redeploy.join()
    assert _state(apps["arm-a"]["status"]) == "DEPLOYING"
    assert _routable(apps["arm-a"])
    assert _state(apps["arm-b"]["status"]) == "DEPLOYING"
    assert not _routable(apps["arm-b"])

    ray.get(serve_instance.release.remote())
    apps = _apps_when(lambda a: all(_state(x["status"]) == "RUNNING" for x in a.values()))
    assert _routable(apps["arm-a"]) and _routable(apps["arm-b"])
    assert serve.get_app_handle("arm-a").remote().result() == "v2"


def test_an_arm_being_built_again_keeps_the_state_it_had():
    """While Ray Serve runs the builder of a changed application, it lists no deployments, and
    the old replicas still serve (seen on a live platform: 200s throughout an arm's rebuild)."""
    building = {"status": "DEPLOYING", "deployments": {}}
    assert _routable(building, was_running=True)
    assert not _routable(building, was_running=False)  # a new arm: nothing serves yet
    assert not _routable({"status": "DEPLOY_FAILED", "deployments": {}}, was_running=True)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Replaceable:
    """Starts at once, unless the marker file exists: then its replacement takes a minute."""

    def __init__(self, marker: str) -> None:
        if os.path.exists(marker):
            time.sleep(60)

    def __call__(self) -> str:
        return "ok"


def test_an_arm_whose_only_replica_died_counts_as_stopped_within_seconds(serve_instance, tmp_path):
    """Ray Serve holds a request for an arm with no live replica until a new one runs (~2.5
    minutes for an engine here): the arm counts as down within seconds of its replica, so that
    the dispatch takes such requests back (test_dispatch.py)."""
    marker = tmp_path / "slow-start"
    serve.run(Replaceable.bind(str(marker)), name="arm-c", route_prefix=None)
    try:
        assert _routable(_serve_applications()["arm-c"])
        marker.touch()
        replica = next(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::arm-c#")
        )
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        killed = time.monotonic()
        apps = _apps_when(lambda a: not _routable(a["arm-c"]), timeout_s=60)
        assert not _routable(apps["arm-c"]), apps["arm-c"]
        # Seconds, not the minutes of a new engine's start: Ray Serve's controller marks the
        # replica dead at its next check (10.0 s after the kill on a loaded 2-core machine).
        assert time.monotonic() - killed < 30
    finally:
        marker.unlink(missing_ok=True)
        serve.delete("arm-c")


@serve.deployment(
    num_replicas=1,
    ray_actor_options={
        "num_cpus": 0,
        # User code on the replica's own event loop, as a busy engine's: a blocking request
        # keeps the controller's calls to the replica waiting.
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    },
)
class Busy:
    async def __call__(self, seconds: float) -> str:
        time.sleep(seconds)  # blocks the replica's event loop
        return "ok"


def test_an_arm_stays_routable_while_a_restarted_controller_recovers_its_busy_replica(
    serve_instance,
):
    """The head pod's loss restarts the Serve controller (GCS fault tolerance); it re-attaches
    to the live replicas, RECOVERING until each answers. An arm that served keeps its traffic
    meanwhile (a platform test lost two requests to a 503 there); one never seen serving does
    not take traffic on a recovering replica's word."""
    handle = serve.run(Busy.bind(), name="arm-d", route_prefix=None)
    try:
        assert handle.remote(0).result() == "ok"
        assert _routable(_serve_applications()["arm-d"])
        busy = handle.remote(6)
        time.sleep(0.5)  # the request holds the replica's loop
        ray.kill(ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve"), no_restart=False)
        apps = _apps_when(
            lambda a: any(
                _state(r["state"]) == "RECOVERING"
                for d in a.get("arm-d", {}).get("deployments", {}).values()
                for r in d["replicas"]
            ),
            timeout_s=30,
        )
        assert _state(apps["arm-d"]["status"]) == "DEPLOYING", apps["arm-d"]
        assert _routable(apps["arm-d"], was_running=True)
        assert not _routable(apps["arm-d"], was_running=False)
        assert busy.result() == "ok"
        apps = _apps_when(lambda a: _state(a["arm-d"]["status"]) == "RUNNING", timeout_s=60)
        assert _routable(apps["arm-d"])
    finally:
        serve.delete("arm-d")
