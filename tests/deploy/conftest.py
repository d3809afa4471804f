"""Shared by the deployment tests: the chart rendered by the real Helm v4 engine (helm-python-sdk)
through helm/generate.py, and validation against the Kubernetes and CRD schemas."""

from __future__ import annotations

import gzip
import importlib.util
import re
import shutil
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.33.0"
# Custom resources the chart renders, and the CRD file holding each one's schema.
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCronJob": "ray.io_raycronjobs.yaml",
}
# The CRDs of KubeRay v1.7 (ray-operator/config/crd/bases) and of the Prometheus operator, kept
# here gzipped: every custom resource the chart renders is validated wherever the tests run, a
# fresh clone included.
VENDORED_CRDS = Path(__file__).with_name("crds")


def _load_generate():
    spec = importlib.util.spec_from_file_location("helm_generate", ROOT / "helm" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def require_tool(name: str) -> str:
    """The path of a command-line tool; CI must have it, elsewhere the test is skipped."""
    # The venv's bin is not on PATH when pytest runs as .venv/bin/pytest.
    path = shutil.which(name) or shutil.which(str(Path(sys.executable).parent / name))
    if path is None:
        unavailable(f"{name} not installed (`make install`)")
    return path


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    text = gzip.decompress((VENDORED_CRDS / (CRD_FILES[kind] + ".gz")).read_bytes()).decode()
    # Go regexps put flags anywhere (`^(?i)...`); Python's `re` wants them first.
    text = re.sub(r"\^\(\?i\)", "(?i)^", text)
    crd = yaml.load(text, Loader=yaml.CSafeLoader)  # libyaml: KubeRay's CRDs take seconds in Python
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


@cache
def crd_validator(kind: str) -> Any:
    """A validator of the CRD's schema, built once. (`jsonschema.validate` would check the schema
    itself against the meta-schema on every call: seconds for KubeRay's, which the API server
    has taken as they are.)"""
    import jsonschema

    return jsonschema.Draft7Validator(crd_schema(kind))


def validate_all(objs: list[dict[str, Any]]) -> None:
    """Validate objects: core kinds against Kubernetes' schemas (strict: unknown fields are
    errors), custom resources against their CRD's openAPIV3Schema."""
    import kubernetes_validate

    for obj in objs:
        kind = obj["kind"]
        if kind not in CRD_FILES:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            crd_validator(kind).validate(obj)


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def pod_specs(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod template of the RayService (head and worker groups)."""
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


def render_objects(profile: str = "cpu", **overrides: Any) -> list[dict[str, Any]]:
    values = generate._merge(generate.profile_values(profile), overrides)
    return generate.objects(generate.render(values))


# Offline Helm's `lookup` finds nothing: these calls of the chart are replaced by the objects an
# upgrade's render would find.
LIVE_RAYSERVICE = 'lookup "ray.io/v1" "RayService" .Release.Namespace $fullname'
LIVE_CONFIGMAP = 'lookup "v1" "ConfigMap" .Release.Namespace (include "specserve.configMapName" .)'


def release_objects(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The release's objects `config apply` writes, among a render's: the live router ConfigMap
    and the RayService, in Helm's install order (ConfigMaps first), in `namespace`."""
    found = [
        o
        for o in objects
        if o["kind"] == "RayService"
        or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router-config"
    ]
    found.sort(key=lambda o: o["kind"])
    assert [o["kind"] for o in found] == ["ConfigMap", "RayService"], found
    return [{**o, "metadata": {**o["metadata"], "namespace": namespace}} for o in found]


def render_upgrade(
    values: dict[str, Any],
    running: dict[str, Any],
    tmp_path,
    live_config: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    namespace: str | None = None,
) -> dict[str, str]:
    """An upgrade's render with `running` as the live RayService (and `live_config` as the live
    router ConfigMap). Offline Helm's `lookup` finds nothing, so a copy of the chart has those
    calls replaced by the objects they would return."""
    import json

    import helm_python as helm

    chart = tmp_path / "chart"
    shutil.copytree(generate.CHART, chart)
    for file, call, found in (
        ("rayservice.yaml", LIVE_RAYSERVICE, running),
        ("_helpers.tpl", LIVE_CONFIGMAP, live_config or {}),
    ):
        template = chart / "templates" / file
        text = template.read_text()
        assert text.count(call) == 1, (file, call)
        template.write_text(text.replace(call, f"fromJson `{json.dumps(found)}`"))
    return helm.Chart.load(str(chart)).render(
        values,
        name=name or generate.RELEASE,
        namespace=namespace or generate.NAMESPACE,
        is_upgrade=True,
    )
