"""Regenerate the deployment files derived from other sources (`make generate`):

- the `config` part of helm/specserve/values.schema.json, from the router config's pydantic schema
  (the rest of that file is written by hand);
- k8s/: plain manifests for users without Helm, rendered from the chart with the real Helm engine
  (helm-python-sdk) for both profiles: objects both profiles share go to `base/`, the others to
  `overlays/cpu` and `overlays/gb200`, the monitoring custom resources to `components/monitoring`.
  They mount an API keys Secret the operator creates (`specserve-api-keys`) instead of the one
  with random keys the chart creates, and on GB200 a model-cache claim the operator creates
  (`specserve-model-cache`, on the cluster's own ReadWriteMany class); each overlay sets the
  image through its `images:` entry.

tests/deploy checks that the committed files equal what this writes.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "specserve"
SCHEMA = CHART / "values.schema.json"
GENERATED_TPL = CHART / "templates" / "_generated.tpl"
K8S = ROOT / "k8s"
PROFILES = {"cpu": [], "gb200": [CHART / "values-gb200.yaml"]}
# What an install adds on the command line for the cluster's own things: GB200's model cache
# needs a storage class that provides ReadWriteMany, and each cluster names its own.
SITE_VALUES: dict[str, dict[str, Any]] = {
    "cpu": {},
    "gb200": {"modelCache": {"storageClassName": "shared-rwx"}},
}
# ... and the commits of the hub repositories whose code its engines run (trust_remote_code),
# which only the operator who reviewed them knows: here a placeholder no repository has, so an
# engine of the plain manifests fails to load rather than run unpinned code until the operator
# writes the commits in (docs/security.md).
PLACEHOLDER_COMMIT = "0" * 40
SITE_PINS = {"cpu": False, "gb200": True}
# The release the plain manifests stand for: `specserve config ... --release specserve`.
RELEASE, NAMESPACE = "specserve", "specserve"
MONITORING = {"enabled": True}
# kube-prometheus-stack's Prometheus selects monitors and rules by its release's name, as
# installed in docs/kubernetes.md.
MONITORING_LABELS = {"release": "kps"}
MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}
# Helm's bookkeeping labels, which plain manifests do not carry.
HELM_LABELS = {"helm.sh/chart": None, "app.kubernetes.io/managed-by": "kustomize"}
# Plain manifests cannot draw random API keys as the chart does at install: they mount the Secret
# the operator creates under the name the chart would give it (docs/kubernetes.md).
API_KEYS_SECRET = f"{RELEASE}-api-keys"
# Nor can they know the cluster's ReadWriteMany storage class: GB200's mount a claim the operator
# creates, under the name the chart would give its own.
MODEL_CACHE_CLAIM = f"{RELEASE}-model-cache"
# What each overlay's kustomization says, above its fields: the objects the operator provides.
OVERLAY_NOTES = {
    "cpu": """\
# Needs Secret specserve-api-keys (data keys api-keys, admin-keys): docs/kubernetes.md.
# Image: an overlay of your own with `images:`, or in a copy of this directory
#   kustomize edit set image ghcr.io/specserve/specserve=REGISTRY/specserve:0.1.0-cpu
""",
    "gb200": """\
# Needs, in the namespace (docs/kubernetes.md, "Without Helm"):
# - Secret specserve-api-keys (data keys api-keys, admin-keys);
# - Secret hf-token, the Hugging Face token the engines download the weights with:
#     kubectl -n specserve create secret generic hf-token --from-literal=token=hf_...
# - PersistentVolumeClaim specserve-model-cache: ReadWriteMany, on a storage class that
#   provides it and lets uid 1000 write.
# And the commits you reviewed of the model's and the drafters' hub repositories, whose code the
# engines run (trust_remote_code), in configmap-specserve-config.yaml: every `revision` there is
# 0000... (no such commit: the engines fail to load until you write them; docs/security.md).
# Image: an overlay of your own with `images:`, or in a copy of this directory
#   kustomize edit set image ghcr.io/specserve/specserve=REGISTRY/specserve:0.1.0-gpu
""",
}


def values_schema() -> dict[str, Any]:
    """values.schema.json with its `config` part regenerated from the pydantic schema."""
    from specserve.config.schema import RouterConfig

    schema = json.loads(SCHEMA.read_text())
    config = RouterConfig.model_json_schema()
    schema["$defs"] = config.pop("$defs")  # `$ref`s point at the document's root
    config["description"] = (
        "The router config (docs/config.md), generated from specserve's pydantic schema: "
        "rendered into the router ConfigMap and the RayService's Serve config."
    )
    schema["properties"]["config"] = config
    return schema


def profile_values(profile: str, *, monitoring: bool = False) -> dict[str, Any]:
    """The values a profile installs with (values.yaml under the profile's file)."""
    values: dict[str, Any] = {}
    for path in PROFILES[profile]:
        values = _merge(values, yaml.safe_load(path.read_text()))
    values = _merge(values, SITE_VALUES[profile])
    if SITE_PINS[profile]:
        values["config"] = pinned(values["config"], PLACEHOLDER_COMMIT)
    if monitoring:
        monitors = {"podMonitor": MONITORING, "prometheusRule": MONITORING}
        values = _merge(values, {"monitoring": {**monitors, "labels": MONITORING_LABELS}})
    return values


def pinned(config: dict[str, Any], commit: str) -> dict[str, Any]:
    """`config` with every hub source (the model, each arm's drafter) pinned to `commit`."""
    from specserve.config.schema import is_hub_id

    config = copy.deepcopy(config)
    if is_hub_id(config["model"]["source"]):
        config["model"]["revision"] = commit
    for arm in config["arms"]:
        speculative = arm.get("speculative", {})
        if is_hub_id(speculative.get("model", "")):
            speculative["revision"] = commit
    return config


def manifest_values(profile: str, *, monitoring: bool = False) -> dict[str, Any]:
    """The values k8s/ is rendered with: the profile's, with the operator's API keys Secret."""
    values = profile_values(profile, monitoring=monitoring)
    values = _merge(values, {"apiKeys": {"existingSecret": API_KEYS_SECRET}})
    if values.get("modelCache", {}).get("enabled"):
        values = _merge(values, {"modelCache": {"existingClaim": MODEL_CACHE_CLAIM}})
    return values


def render(values: dict[str, Any], *, name: str = RELEASE, namespace: str = NAMESPACE) -> dict:
    """Render the chart with the real Helm engine: {template path: manifest text}."""
    import helm_python as helm

    return helm.Chart.load(str(CHART)).render(
        values, name=name, namespace=namespace, is_install=True
    )


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty templates left out)."""
    found = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".txt"):
            continue
        found += [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]
    return found


# libyaml's loader where PyYAML has it: the rendered dashboards alone take Python's a second.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def plain(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the plain manifests carry it: Helm's own labels swapped for kustomize's."""
    obj = json.loads(json.dumps(obj))
    for labels in _label_maps(obj):
        for key, value in HELM_LABELS.items():
            if key in labels:
                if value is None:
                    del labels[key]
                else:
                    labels[key] = value
    return obj


def key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def k8s_files() -> dict[Path, str]:
    """Every file under k8s/, by path relative to it."""
    by_profile = {
        profile: {key(o): plain(o) for o in objects(render(manifest_values(profile)))}
        for profile in PROFILES
    }
    monitoring = [
        plain(o)
        for o in objects(render(manifest_values("cpu", monitoring=True)))
        if o["kind"] in MONITORING_KINDS
    ]
    cpu, gb200 = by_profile["cpu"], by_profile["gb200"]
    shared = sorted(k for k in cpu.keys() & gb200.keys() if cpu[k] == gb200[k])
    files: dict[Path, str] = {}

    def write(
        directory: str, objs: list[dict[str, Any]], extra: dict[str, Any], notes: str = ""
    ) -> None:
        names = []
        for obj in objs:
            name = f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
            files[Path(directory) / name] = _dump(obj)
            names.append(name)
        kustomization = {**extra, "resources": [*extra.get("resources", []), *names]}
        files[Path(directory) / "kustomization.yaml"] = _HEADER + notes + _dump(kustomization)

    base = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    write("base", [cpu[k] for k in shared], base)
    for profile, objs in by_profile.items():
        own = [obj for k, obj in sorted(objs.items()) if k not in shared]
        overlay = {**base, "resources": ["../../base"], "images": [_image_entry(objs)]}
        write(f"overlays/{profile}", own, overlay, OVERLAY_NOTES[profile])
    component = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component"}
    write("components/monitoring", monitoring, component)
    return files


def _image_entry(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """The overlay's `images:` entry for the image of its Ray pods: the chart's own, which
    `kustomize edit set image` or an overlay on top replaces."""
    (service,) = [obj for (kind, _), obj in objs.items() if kind == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    (image,) = images
    name, tag = image.rsplit(":", 1)
    return {"name": name, "newName": name, "newTag": tag}


def generated_tpl() -> str:
    """Template definitions whose source of truth is Python: an arm's keys the router applies
    itself or that become Ray Serve deployment options or user_config, never the engine
    application's args (schema.py's ROUTER_SIDE, DEPLOYMENT_OPTIONS and RELOADED_IN_PLACE), and
    what a hub id looks like (schema.py's HUB_ID_PATTERN: sources that code loading needs
    pinned)."""
    from specserve.config.schema import (
        DEPLOYMENT_OPTIONS,
        HUB_ID_PATTERN,
        RELOADED_IN_PLACE,
        ROUTER_SIDE,
    )

    keys = " ".join(sorted({*ROUTER_SIDE, *DEPLOYMENT_OPTIONS, *RELOADED_IN_PLACE}))
    return (
        "{{- /* Generated from service/specserve/config/schema.py by `make generate`"
        " (helm/generate.py); do not edit. */}}\n"
        '{{- define "specserve.notEngineArgs" -}}\n' + keys + "\n{{- end }}\n"
        '{{- define "specserve.hubIdPattern" -}}\n' + HUB_ID_PATTERN + "\n{{- end }}\n"
    )


def main() -> int:
    SCHEMA.write_text(json.dumps(values_schema(), indent=2) + "\n")
    GENERATED_TPL.write_text(generated_tpl())
    shutil.rmtree(K8S, ignore_errors=True)
    for path, text in k8s_files().items():
        (K8S / path).parent.mkdir(parents=True, exist_ok=True)
        (K8S / path).write_text(text)
    print(f"wrote {SCHEMA.relative_to(ROOT)} and {K8S.relative_to(ROOT)}/")
    return 0


_HEADER = "# Generated from helm/specserve by `make generate` (helm/generate.py); edit the chart.\n"


def _dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False, width=100)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Helm's values merge: maps merge key by key, everything else (lists too) is replaced."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _label_maps(obj: Any):
    """Every `labels` map under `metadata` in an object, pod templates included."""
    if isinstance(obj, dict):
        if isinstance(obj.get("metadata"), dict) and isinstance(
            obj["metadata"].get("labels"), dict
        ):
            yield obj["metadata"]["labels"]
        for value in obj.values():
            yield from _label_maps(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _label_maps(value)


if __name__ == "__main__":
    sys.exit(main())
