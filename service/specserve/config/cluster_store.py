"""The router config of a release on Kubernetes, as a config store (store.py).

The Helm chart creates the live config as a ConfigMap (key `config.yaml`, component
`router-config`) mounted into every Ray pod, where the routers watch it and apply a new valid
revision without restart, and a RayService whose `serveConfigV2` holds the router application
and one application per arm (`arm-<name>`). A weight, routing or limit change therefore needs
only the ConfigMap; a change of an arm's engine part (drafter, k, engine arguments, an arm added
or removed) or of its replicas and queue bounds also needs the arm applications in
`serveConfigV2` patched: Ray Serve then redeploys exactly the changed engines, and applies
replicas and queue bounds to the running ones.

History: one immutable ConfigMap per revision (component `config-history`, named
`<live ConfigMap>-<revision>`, the same `config.yaml` bytes), annotated with when it was last
applied. A rollback writes a record's bytes back, so its revision (a hash of the bytes) returns
with it.

Field ownership: the chart's objects belong to Helm, which (Helm 4) applies them server-side
under field manager `helm`. These commands write the fields they change by server-side apply
under their own field manager, `specserve` (`FIELD_MANAGER`), with `force=true`, owning exactly
`data.config.yaml` and the `specserve.io/revision` annotation of the live ConfigMap and, once an
arm changed, `spec.serveConfigV2` of the RayService: they take those fields from Helm and from
whoever else set them (a write that raced ours still fails, on the resourceVersion each apply
carries). A later `helm upgrade` with the values' config unchanged renders the live ConfigMap's
text (and a Serve config that says the same) back byte for byte, so the fields are shared, not
fought over; one that changes them, and `helm rollback`, stop with a field conflict unless they
run with `--force-conflicts`, which gives the fields back to Helm (docs/kubernetes.md,
docs/runbook.md). History records are created and
annotated by plain writes; Helm never renders them.

`ClusterStore` is this as a config store (store.py, which decides what to record, prune and roll
back to; serve_config.py merges arm applications into `serveConfigV2`); `Cluster` is the thin
layer over the API.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from specserve.config.changes import ArmChanges
from specserve.config.schema import RouterConfig, revision_of
from specserve.config.serve_config import (
    application_changes,
    dump_serve_config,
    merge_arm_applications,
)
from specserve.config.store import ConfigStore, Live, Outcome, Record, StoreError

APP_NAME = "specserve"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
LIVE_COMPONENT = "router-config"
HISTORY_COMPONENT = "config-history"
REVISION_KEY = "specserve.io/revision"  # an annotation of the live ConfigMap, a label of records
APPLIED_AT_ANNOTATION = "specserve.io/applied-at"
# An annotation of the live ConfigMap (the chart's drain.requestSeconds): the longest request the
# release's pods wait for when they stop. Their spec does not follow a config apply.
DRAIN_BUDGET_ANNOTATION = "specserve.io/drain-request-seconds"
CONFIG_KEY = "config.yaml"
RAY_GROUP, RAY_VERSION, RAYSERVICES = "ray.io", "v1", "rayservices"
# The field manager of every write, named in the objects' managedFields and in the conflict a
# `helm upgrade` without --force-conflicts reports after an apply.
FIELD_MANAGER = "specserve"
APPLY_PATCH = "application/apply-patch+yaml"
REQUEST_TIMEOUT_S = 30
# A RayService's resourceVersion moves with every status update of the operator; a patch that
# lost that race is read, merged and sent again this many times.
PATCH_ATTEMPTS = 5
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ClusterError(StoreError):
    """The cluster is not as these commands expect, or refused a request; the message says how."""


class Conflict(ClusterError):
    """409 Conflict: the object changed between our read and our write."""


class AlreadyExists(ClusterError):
    """409 AlreadyExists: an object of that name exists."""


# Time: RFC 3339 in UTC. Applied-at carries microseconds so that two applies within one second
# still order; timestamps the server sets have whole seconds.


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def last_written(obj: dict[str, Any]) -> datetime | None:
    """When the object was last written, as the server recorded it: the newest `managedFields`
    time, else its creation time."""
    meta = obj.get("metadata") or {}
    times = [e["time"] for e in meta.get("managedFields") or [] if e.get("time")]
    if meta.get("creationTimestamp"):
        times.append(meta["creationTimestamp"])
    return max((parse_time(t) for t in times), default=None)


# History records.


def record_of(obj: dict[str, Any]) -> Record:
    """The history record a ConfigMap holds."""
    meta = obj["metadata"]
    text = (obj.get("data") or {}).get(CONFIG_KEY, "")
    stamp = (meta.get("annotations") or {}).get(APPLIED_AT_ANNOTATION)
    try:
        applied_at = parse_time(stamp) if stamp else None
    except ValueError:
        applied_at = None
    # The revision is the hash of the bytes, whatever a label says.
    return Record(
        name=meta["name"],
        revision=revision_of(text.encode()),
        applied_at=applied_at or last_written(obj) or datetime.fromtimestamp(0, UTC),
        text=text,
    )


def record_name(live_name: str, revision: str) -> str:
    return f"{live_name}-{revision}"


def release_labels(release: str) -> dict[str, str]:
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: release}


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def history_configmap(
    live_name: str, release: str, text: str, applied_at: datetime
) -> dict[str, Any]:
    """The body of the history record of `text`."""
    revision = revision_of(text.encode())
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": record_name(live_name, revision),
            "labels": {
                **release_labels(release),
                COMPONENT_LABEL: HISTORY_COMPONENT,
                REVISION_KEY: revision,
            },
            "annotations": {APPLIED_AT_ANNOTATION: format_time(applied_at)},
        },
        "immutable": True,
        "data": {CONFIG_KEY: text},
    }


# The RayService's serveConfigV2.


def load_serve_config(text: str | None, where: str) -> dict[str, Any]:
    try:
        document = yaml.safe_load(text or "")
    except yaml.YAMLError as exc:
        raise ClusterError(f"{where}: spec.serveConfigV2 is not valid YAML: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("applications"), list):
        raise ClusterError(f"{where}: spec.serveConfigV2 has no `applications` list")
    return document


# The API.


class Cluster:
    """The release's live config ConfigMap, its history records and its RayService, in one
    namespace, through the official client (`core`: CoreV1Api, `custom`: CustomObjectsApi).
    Objects come and go as plain JSON-shaped dicts."""

    def __init__(self, core: Any, custom: Any, *, namespace: str, release: str) -> None:
        self.core, self.custom = core, custom
        self.namespace, self.release = namespace, release

    @classmethod
    def connect(
        cls,
        *,
        release: str,
        namespace: str | None = None,
        context: str | None = None,
        kubeconfig: str | None = None,
    ) -> Cluster:
        """Through a kubeconfig (`kubeconfig`, else $KUBECONFIG, else ~/.kube/config) and its
        context, or in a pod through its service account when there is no kubeconfig."""
        from kubernetes import client
        from kubernetes import config as kube_config

        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        paths = [Path(p).expanduser() for p in path.split(os.pathsep) if p]
        try:
            if kubeconfig is None and context is None and not any(p.exists() for p in paths):
                if "KUBERNETES_SERVICE_HOST" not in os.environ:
                    raise ClusterError(f"no kubeconfig at {path} and not running in a pod")
                configuration = client.Configuration()
                kube_config.load_incluster_config(client_configuration=configuration)
                api = client.ApiClient(configuration)
                namespace = namespace or SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
            else:
                contexts, current = kube_config.list_kube_config_contexts(config_file=path)
                chosen = current
                if context is not None:
                    chosen = next((c for c in contexts if c["name"] == context), None)
                    if chosen is None:
                        names = ", ".join(c["name"] for c in contexts)
                        raise ClusterError(f"no context {context!r} in {path}; there are: {names}")
                namespace = namespace or (chosen or {}).get("context", {}).get("namespace")
                api = kube_config.new_client_from_config(config_file=path, context=context)
        except (kube_config.ConfigException, OSError) as exc:
            raise ClusterError(f"kubeconfig: {exc}") from None
        return cls(
            client.CoreV1Api(api),
            client.CustomObjectsApi(api),
            namespace=namespace or "default",
            release=release,
        )

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        """One API request; its failure becomes a ClusterError naming what was attempted."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            result = method(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except ApiException as exc:
            message, reason = _status_message(exc)
            error = {"Conflict": Conflict, "AlreadyExists": AlreadyExists}.get(reason, ClusterError)
            raise error(f"{what}: {message}") from None
        except HTTPError as exc:
            raise ClusterError(f"{what}: cannot reach the API server: {exc}") from None
        return self.core.api_client.sanitize_for_serialization(result)

    def _find_one(self, kind: str, items: list[dict[str, Any]], labels: dict[str, str]) -> dict:
        where = f"in namespace {self.namespace}"
        if not items:
            raise ClusterError(
                f"no {kind} labelled {selector(labels)} {where}: is release "
                f"{self.release!r} installed here (--release, --namespace)?"
            )
        if len(items) > 1:
            names = ", ".join(i["metadata"]["name"] for i in items)
            raise ClusterError(f"several {kind}s labelled {selector(labels)} {where}: {names}")
        return items[0]

    def _configmaps(self, component: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        labels = {**release_labels(self.release), COMPONENT_LABEL: component}
        found = self._call(
            f"list ConfigMaps in {self.namespace}",
            self.core.list_namespaced_config_map,
            self.namespace,
            label_selector=selector(labels),
        )
        return found.get("items") or [], labels

    def live_configmap(self) -> dict[str, Any]:
        items, labels = self._configmaps(LIVE_COMPONENT)
        return self._find_one("ConfigMap", items, labels)

    def records(self) -> list[Record]:
        return [record_of(item) for item in self._configmaps(HISTORY_COMPONENT)[0]]

    def rayservice(self) -> dict[str, Any]:
        labels = release_labels(self.release)
        found = self._call(
            f"list RayServices in {self.namespace}",
            self.custom.list_namespaced_custom_object,
            RAY_GROUP,
            RAY_VERSION,
            self.namespace,
            RAYSERVICES,
            label_selector=selector(labels),
        )
        return self._find_one("RayService", found.get("items") or [], labels)

    def create_configmap(self, body: dict[str, Any]) -> bool:
        """Create; False when one of that name exists already."""
        try:
            self._call(
                f"create ConfigMap {body['metadata']['name']}",
                self.core.create_namespaced_config_map,
                self.namespace,
                body,
                field_manager=FIELD_MANAGER,
            )
        except AlreadyExists:
            return False
        return True

    def apply_configmap(self, body: dict[str, Any]) -> None:
        """Server-side apply of the fields `body` names, taking them from other managers; a
        `metadata.resourceVersion` in it is a precondition (a stale one raises `Conflict`)."""
        self._call(
            f"apply ConfigMap {body['metadata']['name']}",
            self.core.patch_namespaced_config_map,
            body["metadata"]["name"],
            self.namespace,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY_PATCH,
        )

    def delete_configmap(self, name: str) -> None:
        self._call(
            f"delete ConfigMap {name}", self.core.delete_namespaced_config_map, name, self.namespace
        )

    def apply_rayservice(self, body: dict[str, Any]) -> None:
        """As `apply_configmap`, for the RayService."""
        self._call(
            f"apply RayService {body['metadata']['name']}",
            self.custom.patch_namespaced_custom_object,
            RAY_GROUP,
            RAY_VERSION,
            self.namespace,
            RAYSERVICES,
            body["metadata"]["name"],
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY_PATCH,
        )


def _status_message(exc: Any) -> tuple[str, str]:
    """`message (reason)` of the server's Status object, else the HTTP status line; and the
    reason."""
    try:
        status = json.loads(exc.body)
        reason = str(status.get("reason") or exc.status)
        return f"{status['message']} ({reason})", reason
    except (TypeError, ValueError, KeyError):
        return f"HTTP {exc.status} {exc.reason}", ""


# The store.


class ClusterStore(ConfigStore):
    """The release's live ConfigMap, its history records, and the arm applications of its
    RayService's serveConfigV2 (module docstring)."""

    def __init__(
        self, cluster: Cluster, *, check: Callable[[RouterConfig], None] | None = None
    ) -> None:
        super().__init__(check)
        self.cluster = cluster

    def read(self) -> Live:
        """The live ConfigMap, with the RayService whose arms follow it (`source`)."""
        live = self.cluster.live_configmap()
        text = (live.get("data") or {}).get(CONFIG_KEY)
        if text is None:
            raise ClusterError(f"ConfigMap {live['metadata']['name']} has no key {CONFIG_KEY}")
        where = f"ConfigMap {live['metadata']['name']} (namespace {self.cluster.namespace})"
        service = self.cluster.rayservice()
        return Live(
            text,
            where,
            last_written(live),
            engines_where=f"RayService {service['metadata']['name']}",
            source=(live, service),
        )

    def records(self) -> list[Record]:
        return self.cluster.records()

    def admit(self, live: Live, config: RouterConfig) -> None:
        """Also: a request timeout above the release's drain budget would be cut whenever a
        pod stops."""
        super().admit(live, config)
        configmap, _ = live.source
        budget = (configmap["metadata"].get("annotations") or {}).get(DRAIN_BUDGET_ANNOTATION)
        timeout = config.limits.request_timeout_s
        if budget is not None and timeout > float(budget):
            raise ClusterError(
                f"limits.request_timeout_s: {timeout:g} s, more than the {float(budget):g} s "
                f"the release's pods wait for a request when they stop (the chart's "
                f"drain.requestSeconds): raise that with `helm upgrade` first"
            )

    def engine_changes(self, live: Live, old: RouterConfig | None, new: RouterConfig) -> ArmChanges:
        # What runs is the RayService's arm applications, whatever the live config says.
        _, service = live.source
        document = load_serve_config(
            service.get("spec", {}).get("serveConfigV2"), service["metadata"]["name"]
        )
        return application_changes(document, merge_arm_applications(document, new))

    def write_live(self, live: Live, text: str) -> None:
        configmap, _ = live.source
        self.cluster.apply_configmap(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": configmap["metadata"]["name"],
                    # A precondition: a concurrent change of the live config fails this apply.
                    "resourceVersion": configmap["metadata"]["resourceVersion"],
                    "annotations": {REVISION_KEY: revision_of(text.encode())},
                },
                "data": {CONFIG_KEY: text},
            }
        )

    def write_record(self, live: Live, text: str, applied_at: datetime) -> Record:
        configmap, _ = live.source
        body = history_configmap(
            configmap["metadata"]["name"], self.cluster.release, text, applied_at
        )
        if not self.cluster.create_configmap(body):
            # Applied before: its record is written again with the new applied-at, deleted and
            # created rather than patched, so that the config editor's Role may patch the live
            # ConfigMap only (rbac.yaml).
            self.cluster.delete_configmap(body["metadata"]["name"])
            self.cluster.create_configmap(body)
        return record_of(body)

    def delete_record(self, record: Record) -> None:
        self.cluster.delete_configmap(record.name)

    def write_engines(self, live: Live, config: RouterConfig) -> None:
        """Replace the RayService's arm applications, retrying when the object moved meanwhile."""
        _, service = live.source
        for attempt in range(PATCH_ATTEMPTS):
            name = service["metadata"]["name"]
            document = load_serve_config(service.get("spec", {}).get("serveConfigV2"), name)
            merged = merge_arm_applications(document, config)
            if not application_changes(document, merged):
                return
            body = {
                "apiVersion": f"{RAY_GROUP}/{RAY_VERSION}",
                "kind": "RayService",
                "metadata": {
                    "name": name,
                    "resourceVersion": service["metadata"]["resourceVersion"],
                },
                "spec": {"serveConfigV2": dump_serve_config(merged)},
            }
            try:
                self.cluster.apply_rayservice(body)
                return
            except Conflict:
                if attempt == PATCH_ATTEMPTS - 1:
                    raise
                service = self.cluster.rayservice()

    def notes(self, outcome: Outcome) -> list[str]:
        notes = []
        if outcome.old_revision != outcome.new_revision:
            notes.append(
                "live: the routers serve the new revision without restart once the kubelet has "
                "updated the mounted file (about a minute)"
            )
        if outcome.engines:
            notes.append(
                f"{outcome.engines_where}: serveConfigV2 patched; Ray Serve "
                f"{outcome.engines.describe()}"
            )
        else:
            notes.append(f"{outcome.engines_where}: no arm engine changed, nothing redeploys")
        return notes
