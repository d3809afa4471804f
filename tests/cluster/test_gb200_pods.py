"""The GB200 profile's engine pods, started as kubelet starts them up to their Ray container:
the volumes (the model cache claim played by a local directory) and the init container that
checks uid 1000 can write the cache. No GPU is needed for that part; the Ray container is not
started (its image is the GPU one)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster import kuberay
from tests.cluster.conftest import missing
from tests.cluster.kubelet import Claim, Pod, image_env
from tests.cluster.network import PREFIX, Endpoint
from tests.conftest import unavailable
from tests.deploy.conftest import render_objects

pytestmark = pytest.mark.e2e


@pytest.fixture
def engine_pod(tmp_path):
    """A GB200 engine pod's plan and a maker of the pod with its claim played by a directory."""
    if missing():
        unavailable(f"kubelet's part needs {missing()}")
    rendered = kuberay.Rendered(render_objects("gb200"))
    plan = next(p for p in kuberay.pod_plans(rendered.rayservice) if not p.head)
    (claim,) = [
        v["persistentVolumeClaim"]["claimName"]
        for v in plan.volumes
        if "persistentVolumeClaim" in v
    ]
    security = rendered.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"][
        "spec"
    ]["securityContext"]
    # The pod's network is not wired: the init container touches only its volumes.
    endpoint = Endpoint(plan.name, kuberay.NAMESPACE, plan.labels, ip="")
    subprocess.run(["ip", "netns", "add", endpoint.netns], check=True)
    made = []

    def make(directory, *, ownership: bool) -> Pod:
        config_maps = {v["configMap"]["name"]: {} for v in plan.volumes if "configMap" in v}
        secrets = {v["secret"]["secretName"]: {} for v in plan.volumes if "secret" in v}
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n")
        pod = Pod(
            plan, endpoint, tmp_path / f"pod{len(made)}", env={}, config_maps=config_maps,
            secrets=secrets, security=security, model_cache=tmp_path, hosts=hosts,
            claims={claim: Claim(directory, ownership=ownership)},
        )  # fmt: skip
        made.append(pod)
        return pod

    yield plan, make
    subprocess.run(["ip", "netns", "delete", endpoint.netns], check=False)
    assert endpoint.netns.startswith(PREFIX)


def claim_dir(tmp_path, name: str, uid: int, mode: int):
    path = tmp_path / name
    path.mkdir()
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def test_a_gb200_engine_pod_starts_only_on_a_model_cache_its_user_can_write(engine_pod, tmp_path):
    plan, make = engine_pod
    assert [c["name"] for c in plan.init_containers] == ["model-cache-check"]
    env = image_env(tmp_path)
    # File storage that keeps its server's owner (NFS-style: fsGroup does not apply), root's.
    nfs = claim_dir(tmp_path, "nfs", 0, 0o755)
    failed = make(nfs, ownership=False).run_init_containers(env)
    assert failed is not None and "cannot write HF_HOME=/models/huggingface" in failed.stderr
    assert not (nfs / "huggingface").exists()
    # The same storage opened to uid 1000, as docs/kubernetes.md asks of its class.
    opened = claim_dir(tmp_path, "opened", 1000, 0o755)
    assert make(opened, ownership=False).run_init_containers(env) is None
    assert (opened / "huggingface").stat().st_uid == 1000
    # Block storage, root's: kubelet gives it the pod's fsGroup, and the check passes.
    block = claim_dir(tmp_path, "block", 0, 0o755)
    assert make(block, ownership=True).run_init_containers(env) is None
    assert (block / "huggingface").stat().st_gid == 1000
