"""The capture store on Kubernetes (docs/capture.md): a claim every engine pod mounts, named to
the arms' engine replicas by SPECSERVE_CAPTURE_DIR; the head neither mounts nor names it; the
same access-mode rules as the model cache; kept on uninstall."""

from __future__ import annotations

from tests.deploy.conftest import generate, one, pod_specs, render_objects, validate_all
from tests.deploy.test_chart_review import chart_values, refused

SHARED = {"enabled": True, "accessModes": ["ReadWriteMany"], "storageClassName": "nfs"}


def env_of(pod: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def engine_pods(objs: list[dict]) -> list[dict]:
    """The worker pods, where engines capture; the head (no engine) has no capture volume."""
    head, *workers = pod_specs(objs)
    assert "capture-store" not in {v["name"] for v in head["volumes"]}
    assert "SPECSERVE_CAPTURE_DIR" not in env_of(head)
    assert workers
    return workers


def test_off_by_default_no_claim_and_engine_pods_capture_into_a_bounded_emptydir():
    objs = render_objects("cpu")
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    mount_path = chart_values("cpu")["captureStore"]["mountPath"]
    for pod in engine_pods(objs):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["capture-store"]["emptyDir"] == {"sizeLimit": "2Gi"}
        assert env_of(pod)["SPECSERVE_CAPTURE_DIR"] == mount_path


def test_every_engine_pod_mounts_the_store_and_is_told_where_it_is():
    objs = render_objects("cpu", captureStore=SHARED)
    claim = one(objs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "nfs"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    mount_path = chart_values("cpu")["captureStore"]["mountPath"]
    for pod in engine_pods(objs):
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {"capture-store": claim["metadata"]["name"]}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["capture-store"] == mount_path == env_of(pod)["SPECSERVE_CAPTURE_DIR"]
    validate_all(objs)


def test_an_existing_claim_is_mounted_and_none_is_created():
    objs = render_objects("cpu", captureStore={**SHARED, "existingClaim": "captured"})
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    for pod in pod_specs(objs)[1:]:
        assert {"name": "capture-store", "persistentVolumeClaim": {"claimName": "captured"}} in pod[
            "volumes"
        ]


def test_a_store_several_pods_cannot_share_is_refused_naming_the_key():
    once = generate._merge(generate.profile_values("cpu"), {"captureStore": {"enabled": True}})
    assert "captureStore.accessModes" in refused(once)
    no_class = generate._merge(
        generate.profile_values("cpu"),
        {"captureStore": {"enabled": True, "accessModes": ["ReadWriteMany"]}},
    )
    assert "captureStore.storageClassName" in refused(no_class)
