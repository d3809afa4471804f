"""k8s/: the plain manifests for users without Helm. `kubectl kustomize` renders each overlay to
the same objects the chart installs for that profile, every object validates, and the committed
files are what helm/generate.py writes from the chart."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import generate, require_tool, validate_all


def kustomize(directory: Path) -> list[dict]:
    kubectl = require_tool("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def keyed(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {generate.key(o): o for o in objs}


def test_committed_manifests_are_what_the_generator_writes():
    expected = generate.k8s_files()
    committed = {
        path.relative_to(generate.K8S): path.read_text()
        for path in generate.K8S.rglob("*")
        if path.is_file()
    }
    assert committed == expected, "run `make generate`"


@pytest.mark.parametrize("profile", sorted(generate.PROFILES))
def test_overlay_renders_the_objects_the_chart_installs(profile):
    from_kustomize = keyed(kustomize(generate.K8S / "overlays" / profile))
    from_helm = keyed(
        [
            generate.plain(o)
            for o in generate.objects(generate.render(generate.manifest_values(profile)))
        ]
    )
    assert from_kustomize.keys() == from_helm.keys()
    for k, obj in from_kustomize.items():
        assert obj == from_helm[k], k
    validate_all(list(from_kustomize.values()))


def test_monitoring_component_adds_the_chart_monitors(tmp_path):
    # An overlay of the user's own, as the README shows it (kustomize wants relative paths).
    shutil.copytree(generate.K8S, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "cpu-monitoring"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../cpu"],
                "components": ["../../components/monitoring"],
            }
        )
    )
    from_kustomize = keyed(kustomize(overlay))
    values = generate.manifest_values("cpu", monitoring=True)
    from_helm = keyed([generate.plain(o) for o in generate.objects(generate.render(values))])
    assert from_kustomize == from_helm
    assert {kind for kind, _ in from_kustomize} >= generate.MONITORING_KINDS


@pytest.mark.parametrize("profile", sorted(generate.PROFILES))
def test_overlay_mounts_the_operators_keys_secret_behind_the_network_policy(profile):
    """No keys are committed: the pods mount the Secret the operator creates (docs/kubernetes.md),
    under the name the chart gives its own, and the deny-by-default policy comes along."""
    objs = kustomize(generate.K8S / "overlays" / profile)
    kinds = [o["kind"] for o in objs]
    assert "Secret" not in kinds
    assert kinds.count("NetworkPolicy") == 1
    (service,) = [o for o in objs if o["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secrets == [generate.API_KEYS_SECRET] == ["specserve-api-keys"]
    assert "api_keys_file" in service["spec"]["serveConfigV2"]
