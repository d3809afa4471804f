"""The router config on a Kubernetes cluster: apply a file, keep a bounded history, roll back.

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
carries). A later `helm upgrade` or `helm rollback` then meets those fields owned by `specserve`
with other values and stops with a field conflict unless it runs with `--force-conflicts`, which
gives them back to Helm (docs/kubernetes.md, docs/runbook.md). History records are created and
annotated by plain writes; Helm never renders them.

The decisions (which records to prune, which revision to roll back to, how arm applications
merge into `serveConfigV2`) are plain functions; `Cluster` is the thin layer over the API.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specserve.config.schema import (
    DEPLOYMENT_OPTIONS,
    ArmChange,
    ArmEngineConfig,
    ArmSide,
    ConfigError,
    ModelConfig,
    RouterConfig,
    arm_change,
    parse_config,
    revision_of,
)
from specserve.config.serve_config import (
    ARM_APP_PREFIX,
    ARM_ARG,
    EXPOSE_HTTP_ARG,
    MODEL_ARG,
    arm_application,
)

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
DEFAULT_KEEP = 10
# The field manager of every write, named in the objects' managedFields and in the conflict a
# `helm upgrade` without --force-conflicts reports after an apply.
FIELD_MANAGER = "specserve"
APPLY_PATCH = "application/apply-patch+yaml"
REQUEST_TIMEOUT_S = 30
# A RayService's resourceVersion moves with every status update of the operator; a patch that
# lost that race is read, merged and sent again this many times.
PATCH_ATTEMPTS = 5
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ClusterError(Exception):
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


@dataclass(frozen=True)
class Record:
    """One history record: a revision's bytes and when it was last applied."""

    name: str
    revision: str
    applied_at: datetime
    text: str

    @classmethod
    def from_configmap(cls, obj: dict[str, Any]) -> Record:
        meta = obj["metadata"]
        text = (obj.get("data") or {}).get(CONFIG_KEY, "")
        stamp = (meta.get("annotations") or {}).get(APPLIED_AT_ANNOTATION)
        try:
            applied_at = parse_time(stamp) if stamp else None
        except ValueError:
            applied_at = None
        # The revision is the hash of the bytes, whatever a label says.
        return cls(
            name=meta["name"],
            revision=revision_of(text.encode()),
            applied_at=applied_at or last_written(obj) or datetime.fromtimestamp(0, UTC),
            text=text,
        )


def newest_first(records: Iterable[Record]) -> list[Record]:
    return sorted(records, key=lambda r: (r.applied_at, r.name), reverse=True)


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


def next_applied_at(now: datetime, records: Iterable[Record]) -> datetime:
    """`now`, or just after the newest record when a clock is behind: the revision applied
    last must sort first."""
    latest = max((r.applied_at for r in records), default=None)
    if latest is not None and latest >= now:
        return latest + timedelta(microseconds=1)
    return now


def records_to_prune(records: Sequence[Record], keep: int, live_revision: str) -> list[Record]:
    """The records beyond the `keep` applied most recently, never the live revision's."""
    if keep < 1:
        raise ValueError("keep at least one record")
    return [r for r in newest_first(records)[keep:] if r.revision != live_revision]


def previous_record(records: Sequence[Record], live_revision: str) -> Record:
    """What a rollback without `--to` restores: the record applied most recently other than the
    live one (after a rollback, the revision it rolled back from)."""
    for record in newest_first(records):
        if record.revision != live_revision:
            return record
    raise ClusterError(
        f"no earlier revision to roll back to: the history holds only {live_revision}"
        if records
        else "no history records yet: `specserve config apply` records them"
    )


def resolve_revision(records: Sequence[Record], wanted: str) -> Record:
    """The record whose revision is `wanted` or starts with it (a unique prefix)."""
    known = ", ".join(r.revision for r in newest_first(records)) or "none"
    wanted = wanted.strip().lower()
    if not wanted:
        raise ClusterError(f"name a revision; known revisions: {known}")
    exact = [r for r in records if r.revision == wanted]
    matches = exact or [r for r in records if r.revision.startswith(wanted)]
    if not matches:
        raise ClusterError(f"no revision {wanted!r} in the history; known revisions: {known}")
    if len(matches) > 1:
        which = ", ".join(sorted(r.revision for r in matches))
        raise ClusterError(
            f"revision {wanted!r} is ambiguous (matches {which}); known revisions: {known}"
        )
    return matches[0]


# The arm applications of serveConfigV2.


def load_serve_config(text: str | None, where: str) -> dict[str, Any]:
    try:
        document = yaml.safe_load(text or "")
    except yaml.YAMLError as exc:
        raise ClusterError(f"{where}: spec.serveConfigV2 is not valid YAML: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("applications"), list):
        raise ClusterError(f"{where}: spec.serveConfigV2 has no `applications` list")
    return document


def is_arm_application(app: Any) -> bool:
    return isinstance(app, dict) and str(app.get("name", "")).startswith(ARM_APP_PREFIX)


def arm_applications(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {app["name"]: app for app in document["applications"] if is_arm_application(app)}


def arm_of_application(app: dict[str, Any]) -> ArmSide | None:
    """The model and arm an arm application runs (the inverse of `arm_application`), None when
    its args are not a valid arm (written by hand, or by another version)."""
    args = app.get("args") or {}
    options = {
        key: deployment[option]
        for deployment in app.get("deployments") or []
        for key, option in DEPLOYMENT_OPTIONS.items()
        if option in deployment
    }
    try:
        model = ModelConfig.model_validate(args[MODEL_ARG])
        return model, ArmEngineConfig.model_validate({**args[ARM_ARG], **options})
    except (KeyError, TypeError, ValidationError):
        return None


def application_change(old: dict[str, Any] | None, new: dict[str, Any] | None) -> ArmChange:
    """`config.arm_change` between two arm applications; one that cannot be read restarts when
    it differs at all."""
    name = str((new or old or {}).get("name", ""))
    before = None if old is None else arm_of_application(old)
    after = None if new is None else arm_of_application(new)
    if (old is not None and before is None) or (new is not None and after is None):
        return ArmChange(name, "unchanged" if old == new else "restart")
    return arm_change(name, before, after)


def merge_arm_applications(document: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """`document` with its arm applications replaced by those of `config`, as far as they
    change (`config.arm_change`, on the normalised config).

    An unchanged arm keeps its running application as it is (written out, a default the file
    left out or spelled out would otherwise redeploy it); an arm changed in place keeps it with
    the new deployment options; a restarted or new arm gets the new application. Every other
    application (the router, whose arguments come from the chart's values) and every top-level
    key stay as they are; the arms take the place of the first arm application. Whether the arms
    answer under their own route (`expose_http`) is kept from the running document.
    """
    apps = document["applications"]
    expose = any(
        (app.get("args") or {}).get(EXPOSE_HTTP_ARG) for app in apps if is_arm_application(app)
    )
    running = arm_applications(document)
    arms = []
    for arm in config.arms:
        new = arm_application(arm, config, expose_http=expose)
        old = running.get(new["name"])
        kind = application_change(old, new).kind
        if old is None or kind == "restart":
            arms.append(new)
        elif kind == "unchanged":
            arms.append(old)
        else:
            kept = {key: value for key, value in old.items() if key != "deployments"}
            arms.append(
                {**kept, **({"deployments": new["deployments"]} if "deployments" in new else {})}
            )
    first = next((i for i, app in enumerate(apps) if is_arm_application(app)), len(apps))
    others = [app for app in apps if not is_arm_application(app)]
    return {**document, "applications": [*others[:first], *arms, *others[first:]]}


@dataclass(frozen=True)
class ArmChanges:
    """Arm applications Ray Serve redeploys (new, or a changed engine), rescales in place (only
    replica or queue settings changed) and deletes."""

    redeployed: tuple[str, ...] = ()
    rescaled: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.redeployed or self.rescaled or self.removed)


def arm_changes(before: dict[str, Any], after: dict[str, Any]) -> ArmChanges:
    """What changes from the arms of one Serve document to another's, classified as `specserve
    config diff` classifies configs (`config.arm_change`)."""
    old, new = arm_applications(before), arm_applications(after)
    changes = [application_change(old.get(name), app) for name, app in new.items()]
    return ArmChanges(
        redeployed=tuple(
            name
            for name, change in zip(new, changes, strict=True)
            if change.kind in ("added", "restart")
        ),
        rescaled=tuple(
            name for name, change in zip(new, changes, strict=True) if change.kind == "in place"
        ),
        removed=tuple(name for name in old if name not in new),
    )


def dump_serve_config(document: dict[str, Any]) -> str:
    return yaml.safe_dump(document, sort_keys=False)


def describe_arms(text: str) -> str:
    """`name=weight ...` of a record, or why it cannot be read."""
    try:
        config = parse_config(text)
    except ConfigError as exc:
        return f"(invalid: {exc})"
    return " ".join(f"{arm.name}={arm.weight:g}" for arm in config.arms)


def history_table(records: Sequence[Record], live_revision: str) -> list[str]:
    """Newest first: revision, applied-at, arms with weights, and which one is live."""
    rows = [
        (
            r.revision,
            r.applied_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "live" if r.revision == live_revision else "",
            describe_arms(r.text),
        )
        for r in newest_first(records)
    ]
    header = ("REVISION", "APPLIED AT", "LIVE", "ARMS")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        + "  "
        + row[3]
        for row in [header, *rows]
    ]


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
        return [Record.from_configmap(item) for item in self._configmaps(HISTORY_COMPONENT)[0]]

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


# The commands.


@dataclass(frozen=True)
class Outcome:
    """What an apply or a rollback found and did."""

    configmap: str
    rayservice: str
    old_revision: str
    new_revision: str
    old_config: RouterConfig | None  # None when the live bytes are not a valid config
    new_config: RouterConfig
    arms: ArmChanges = field(default_factory=ArmChanges)
    pruned: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.old_revision != self.new_revision or bool(self.arms)


def apply(
    cluster: Cluster,
    text: str,
    config: RouterConfig,
    *,
    keep: int = DEFAULT_KEEP,
    now: datetime | None = None,
) -> Outcome:
    """Make `text` (already validated as `config`) the live config, record it, prune history."""
    outcome, records = _switch(cluster, text, config, now=now)
    if not outcome.changed:
        return outcome
    pruned = tuple(r.name for r in records_to_prune(records, keep, outcome.new_revision))
    for name in pruned:
        cluster.delete_configmap(name)
    return replace(outcome, pruned=pruned)


def rollback(cluster: Cluster, to: str | None = None, *, now: datetime | None = None) -> Outcome:
    """Restore a recorded revision: `to` (a unique prefix), else the one applied before."""
    live = cluster.live_configmap()
    live_revision = revision_of(_config_text(live).encode())
    records = cluster.records()
    record = (
        previous_record(records, live_revision) if to is None else resolve_revision(records, to)
    )
    config = parse_config(record.text, source=f"history record {record.name}")
    return _switch(cluster, record.text, config, now=now)[0]


def live_text(cluster: Cluster) -> str:
    """The live config's text."""
    return _config_text(cluster.live_configmap())


def _check_drain_budget(live: dict[str, Any], config: RouterConfig) -> None:
    """A request timeout above the release's drain budget would be cut whenever a pod stops:
    refused before anything is written."""
    budget = (live["metadata"].get("annotations") or {}).get(DRAIN_BUDGET_ANNOTATION)
    timeout = config.limits.request_timeout_s
    if budget is not None and timeout > float(budget):
        raise ClusterError(
            f"limits.request_timeout_s: {timeout:g} s, more than the {float(budget):g} s the "
            f"release's pods wait for a request when they stop (the chart's "
            f"drain.requestSeconds): raise that with `helm upgrade` first"
        )


def _config_text(live: dict[str, Any]) -> str:
    text = (live.get("data") or {}).get(CONFIG_KEY)
    if text is None:
        raise ClusterError(f"ConfigMap {live['metadata']['name']} has no key {CONFIG_KEY}")
    return text


def _switch(
    cluster: Cluster, text: str, config: RouterConfig, *, now: datetime | None
) -> tuple[Outcome, list[Record]]:
    """Write `text` to the live ConfigMap and the arms of `config` to the RayService, recording
    both the config that was live and the new one. Returns the outcome and the records as they
    are now.

    Order: the live config is recorded first (so it can be restored whatever fails next), then the
    ConfigMap changes, then its record is stamped, then the arms. The routers leave an arm that is
    not running out of the selection, so a new arm waits for its engine and a removed one stops
    getting traffic before its application goes.
    """
    live = cluster.live_configmap()
    _check_drain_budget(live, config)
    service = cluster.rayservice()
    live_name, service_name = live["metadata"]["name"], service["metadata"]["name"]
    old_text = _config_text(live)
    old_revision, new_revision = revision_of(old_text.encode()), revision_of(text.encode())
    document = load_serve_config(service.get("spec", {}).get("serveConfigV2"), service_name)
    changes = arm_changes(document, merge_arm_applications(document, config))
    try:
        old_config: RouterConfig | None = parse_config(old_text)
    except ConfigError:
        old_config = None
    outcome = Outcome(
        configmap=live_name,
        rayservice=service_name,
        old_revision=old_revision,
        new_revision=new_revision,
        old_config=old_config,
        new_config=config,
        arms=changes,
    )
    records = cluster.records()
    if not outcome.changed:
        return outcome, records
    now = now or datetime.now(UTC)
    by_revision = {r.revision: r for r in records}
    if old_revision not in by_revision:
        # Installed by the chart (or written by hand): recorded with the time it was written.
        written = min(last_written(live) or now, now)
        body = history_configmap(live_name, cluster.release, old_text, written)
        cluster.create_configmap(body)
        by_revision[old_revision] = Record.from_configmap(body)
    if old_revision != new_revision:
        cluster.apply_configmap(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": live_name,
                    # A precondition: a concurrent change of the live config fails this apply.
                    "resourceVersion": live["metadata"]["resourceVersion"],
                    "annotations": {REVISION_KEY: new_revision},
                },
                "data": {CONFIG_KEY: text},
            }
        )
    applied_at = next_applied_at(now, by_revision.values())
    body = history_configmap(live_name, cluster.release, text, applied_at)
    if not cluster.create_configmap(body):
        # Applied before: its record is written again with the new applied-at, deleted and
        # created rather than patched, so that the config editor's Role may patch the live
        # ConfigMap only (rbac.yaml).
        cluster.delete_configmap(body["metadata"]["name"])
        cluster.create_configmap(body)
    by_revision[new_revision] = Record.from_configmap(body)
    if changes:
        _patch_arms(cluster, config, service)
    return outcome, list(by_revision.values())


def _patch_arms(cluster: Cluster, config: RouterConfig, service: dict[str, Any]) -> None:
    """Replace the RayService's arm applications, retrying when the object moved meanwhile."""
    for attempt in range(PATCH_ATTEMPTS):
        name = service["metadata"]["name"]
        document = load_serve_config(service.get("spec", {}).get("serveConfigV2"), name)
        merged = merge_arm_applications(document, config)
        if not arm_changes(document, merged):
            return
        body = {
            "apiVersion": f"{RAY_GROUP}/{RAY_VERSION}",
            "kind": "RayService",
            "metadata": {"name": name, "resourceVersion": service["metadata"]["resourceVersion"]},
            "spec": {"serveConfigV2": dump_serve_config(merged)},
        }
        try:
            cluster.apply_rayservice(body)
            return
        except Conflict:
            if attempt == PATCH_ATTEMPTS - 1:
                raise
            service = cluster.rayservice()


def history(cluster: Cluster) -> list[str]:
    """The history table, and a note when the live config has no record yet."""
    live = cluster.live_configmap()
    live_revision = revision_of(_config_text(live).encode())
    records = cluster.records()
    lines = history_table(records, live_revision)
    if live_revision not in {r.revision for r in records}:
        lines.append(
            f"live revision {live_revision} (ConfigMap {live['metadata']['name']}) has no record "
            "yet; the next apply or rollback records it"
        )
    return lines
