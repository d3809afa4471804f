"""Shared by the deployment tests: the chart rendered by the real Helm v4 engine (helm-python-sdk)
through helm/generate.py, and validation against the Kubernetes and CRD schemas."""

from __future__ import annotations

import gzip
import importlib.util
import os
import re
import shutil
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "schemas" / "crds"
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
# KubeRay v1.7's RayJob and RayCronJob CRDs (ray-operator/config/crd/bases), kept here gzipped:
# the chart's optional `drafter adapt` job is validated wherever the tests run.
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
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing; `make install` / .ci/run install it")
        pytest.skip(f"{name} not installed")
    return path


def _crd_text(kind: str) -> str | None:
    vendored = VENDORED_CRDS / (CRD_FILES[kind] + ".gz")
    if vendored.exists():
        return gzip.decompress(vendored.read_bytes()).decode()
    path = CRDS / CRD_FILES[kind]
    return path.read_text() if path.exists() else None


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    text = _crd_text(kind)
    assert text is not None, kind
    crd = yaml.safe_load(text)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    text = yaml.safe_dump(version["schema"]["openAPIV3Schema"])
    # Go regexps put flags anywhere (`^(?i)...`); Python's `re` wants them first.
    text = re.sub(r"\^\(\?i\)", "(?i)^", text)
    return yaml.safe_load(text)


def validate_all(objs: list[dict[str, Any]]) -> None:
    """Validate objects: core kinds against Kubernetes' schemas (strict: unknown fields are
    errors), custom resources against their CRD's openAPIV3Schema. Where the CRD schemas are not
    at hand (they live beside the repository), the core kinds are still checked before the test
    is skipped."""
    import jsonschema
    import kubernetes_validate

    unchecked = []
    for obj in objs:
        kind = obj["kind"]
        if kind not in CRD_FILES:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        elif _crd_text(kind) is not None:
            jsonschema.validate(obj, crd_schema(kind), cls=jsonschema.Draft7Validator)
        else:
            unchecked.append(kind)
    if unchecked:
        pytest.skip(f"CRD schemas not found at {CRDS}: {sorted(set(unchecked))} not validated")


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
