"""A stand-in for the Kubernetes API server: an in-process HTTP server for the deploy tests.

No Kubernetes API server can run on this machine, so the tests of `specserve config apply /
history / rollback` point a kubeconfig at this one and the official `kubernetes` client talks
HTTP to it. It implements only the endpoints those commands use, with the real wire protocol:

- ConfigMaps, `/api/v1/namespaces/{namespace}/configmaps[/{name}]`: list (with `labelSelector`),
  get, create, replace (PUT), patch (merge patch or server-side apply), delete.
- RayServices, `/apis/ray.io/v1/namespaces/{namespace}/rayservices[/{name}]`: list (with
  `labelSelector`), get, patch (merge patch or server-side apply).

As the real server does: bodies are JSON; errors are `kind: Status` objects with `reason` and
`code` (401 Unauthorized, 400 BadRequest, 404 NotFound, 405 MethodNotAllowed, 409 AlreadyExists
or Conflict, 415 UnsupportedMediaType, 422 Invalid); every write takes the next cluster-wide
`metadata.resourceVersion`, and a replace or patch that names another resourceVersion than the
stored one is a 409 Conflict (an apply too); objects get a `uid` and a `creationTimestamp`; a
RayService's `metadata.generation` counts its spec changes; the `data`, `binaryData` and
`immutable` fields of an `immutable: true` ConfigMap cannot change (422 Invalid) while its
metadata can.

Field ownership, as server-side apply keeps it: `metadata.managedFields` holds one entry per
manager and operation (the `fieldManager` query parameter, else the user agent up to its first
`/`), with the time of its last write and the fields it owns (`fieldsV1`).
- An update (create, replace, merge patch) is an `Update` operation: the fields whose value it
  changed become its manager's and leave every other manager's set. It never conflicts.
- An apply (`PATCH` with `Content-Type: application/apply-patch+yaml`, the body a whole object in
  YAML or JSON, `fieldManager` required, `force` optional) is an `Apply` operation: its manager's
  set becomes exactly the fields the body names; a field it names that another manager owns with
  a different value is a 409 Conflict (`reason: Conflict`, one `FieldManagerConflict` cause per
  field in `details.causes`, the message as the real server words it) unless `force=true`, which
  takes the field from the others; a field its manager applied before and no longer names is
  removed from the object when no other manager owns it. An apply to an absent object creates it.

Fields are tracked at the granularity server-side apply uses for objects without schema hints:
maps key by key, lists and scalars as one field each (no list-map keys, so a list is owned
whole, and no `.` entries for the maps themselves); `apiVersion`, `kind` and the metadata the
server sets are nobody's.

Not implemented: other resources and verbs (405), watches, JSON patch and strategic merge patch
(415), subresources (`status` is written through the main resource), field selectors, set-based
label selectors (400), dry runs, authorization (one bearer token is checked), admission,
finalizers and garbage collection, schema-aware apply (defaults, `x-kubernetes-list-type`) and
the managed-fields conversion between API versions.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
# Set by the server, owned by no manager.
SERVER_FIELDS = frozenset(
    {
        ("apiVersion",),
        ("kind",),
        ("metadata", "name"),
        ("metadata", "namespace"),
        ("metadata", "uid"),
        ("metadata", "resourceVersion"),
        ("metadata", "creationTimestamp"),
        ("metadata", "generation"),
        ("metadata", "managedFields"),
    }
)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class Resource:
    def __init__(
        self, group: str, version: str, plural: str, kind: str, verbs: frozenset[str]
    ) -> None:
        self.group, self.version, self.plural, self.kind = group, version, plural, kind
        self.verbs = verbs

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """As the real server names it in messages: `configmaps`, `rayservices.ray.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


CONFIGMAPS = Resource(
    "",
    "v1",
    "configmaps",
    "ConfigMap",
    frozenset({"list", "get", "create", "update", "patch", "delete"}),
)
RAYSERVICES = Resource(
    "ray.io", "v1", "rayservices", "RayService", frozenset({"list", "get", "patch"})
)
ROUTES = [
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/configmaps(?:/(?P<name>[^/]+))?$"), CONFIGMAPS),
    (
        re.compile(r"^/apis/ray\.io/v1/namespaces/(?P<ns>[^/]+)/rayservices(?:/(?P<name>[^/]+))?$"),
        RAYSERVICES,
    ),
]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def now_rfc3339() -> str:
    """Server timestamps are RFC 3339 in UTC, to the second."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


Path = tuple[str, ...]


def fields_of(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """The object's fields as ownership sees them: {path: value}, maps walked key by key, lists,
    scalars and empty maps as single fields."""
    if not isinstance(obj, dict) or (not obj and prefix):
        return {prefix: obj} if prefix else {}
    found: dict[Path, Any] = {}
    for key, value in obj.items():
        path = (*prefix, key)
        if path not in SERVER_FIELDS:
            found.update(fields_of(value, path))
    return found


def value_at(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def set_at(obj: dict[str, Any], path: Path, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = copy.deepcopy(value)


def remove_at(obj: dict[str, Any], path: Path) -> None:
    """Remove a field, and the maps it leaves empty."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 2, -1, -1):
        if not parents[depth + 1]:
            parents[depth].pop(path[depth], None)


def overlaps(a: Path, b: Path) -> bool:
    """One field contains the other (a map field set whole against one of its keys)."""
    return a[: len(b)] == b or b[: len(a)] == a


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def from_fields_v1(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for key, child in tree.items():
        if not key.startswith("f:"):
            continue  # `.` and list keys (k:, v:, i:), which this stand-in never writes
        path = (*prefix, key[2:])
        paths |= from_fields_v1(child, path) if child else {path}
    return paths


def path_text(path: Path) -> str:
    """As the API server prints a field path: `.data.config.yaml`."""
    return "".join(f".{key}" for key in path)


class Owner:
    """One `managedFields` entry: a manager, its operation and the fields it owns."""

    def __init__(self, manager: str, operation: str, api_version: str, time: str, fields: set):
        self.manager, self.operation, self.api_version = manager, operation, api_version
        self.time, self.fields = time, fields

    @classmethod
    def read(cls, obj: dict[str, Any] | None) -> list[Owner]:
        entries = ((obj or {}).get("metadata") or {}).get("managedFields") or []
        return [
            cls(
                e.get("manager", ""),
                e.get("operation", "Update"),
                e.get("apiVersion", ""),
                e.get("time", ""),
                from_fields_v1(e.get("fieldsV1") or {}),
            )
            for e in entries
        ]

    def entry(self) -> dict[str, Any]:
        return {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(self.fields),
        }

    def printed(self) -> str:
        """As the API server names a manager in a conflict."""
        if self.operation == "Update":
            return f'"{self.manager}" using {self.api_version}'
        return f'"{self.manager}"'


def conflict_error(conflicts: list[tuple[Owner, Path]]) -> ApiError:
    causes = [
        {
            "reason": "FieldManagerConflict",
            "message": f"conflict with {owner.printed()}",
            "field": path_text(path),
        }
        for owner, path in conflicts
    ]
    if len(conflicts) == 1:
        owner, path = conflicts[0]
        message = (
            f"Apply failed with 1 conflict: conflict with {owner.printed()}: {path_text(path)}"
        )
    else:
        by_owner: dict[str, list[str]] = {}
        for owner, path in conflicts:
            by_owner.setdefault(owner.printed(), []).append(path_text(path))
        lines = [
            f"conflicts with {who}:\n" + "\n".join(f"- {p}" for p in paths)
            for who, paths in by_owner.items()
        ]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, "Conflict", message, {"causes": causes})


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """Equality-based terms: `k=v`, `k==v`, `k!=v`, `k` (exists), `!k` (does not exist)."""
    terms: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise ApiError(400, "BadRequest", f"set-based selector not implemented here: {term}")
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "==" in term or "=" in term:
            key, value = re.split("==?", term, maxsplit=1)
            terms.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "!", None))
        else:
            terms.append((term, "exists", None))
    return terms


def selector_matches(terms: list[tuple[str, str, str | None]], labels: dict[str, str]) -> bool:
    for key, op, value in terms:
        present = key in labels
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and present and labels[key] == value:
            return False
        if op == "exists" and not present:
            return False
        if op == "!" and present:
            return False
    return True


class KubeStandin:
    """The API server's objects in memory, served over HTTP on 127.0.0.1 (see the module doc)."""

    def __init__(self, token: str = "standin-token") -> None:
        self.token = token
        self.lock = threading.RLock()
        self.store: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.resource_version = 0
        # Every request as (method, path with query, content type), for tests to inspect.
        self.requests: list[tuple[str, str, str | None]] = []
        # The (resource, verb) pairs requested, as RBAC names them: ("configmaps", "list").
        self.verbs: set[tuple[str, str]] = set()
        # Called after each request, before its response, with (method, path); a test uses it to
        # change objects between two requests of a command, as another writer would.
        self.after_request: Callable[[str, str], None] | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: pathlib.Path, namespace: str) -> pathlib.Path:
        """A kubeconfig whose current context is this server, with its token and `namespace`."""
        context = {"cluster": "standin", "user": "operator", "namespace": namespace}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": self.token}}],
            "contexts": [{"name": "standin", "context": context}],
            "current-context": "standin",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> KubeStandin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # In-process access, for seeding objects and for assertions.

    def add(
        self, obj: dict[str, Any], *, manager: str = "helm", force: bool = False
    ) -> dict[str, Any]:
        """Apply an object server-side as Helm 4 installs and upgrades a chart's objects (or
        another owner would); returns it stored. Raises ApiError, e.g. a 409 field conflict."""
        resource = CONFIGMAPS if obj.get("kind") == "ConfigMap" else RAYSERVICES
        meta = obj["metadata"]
        return self.apply(
            resource, meta["namespace"], meta["name"], copy.deepcopy(obj), manager, force=force
        )

    def owners(self, plural: str, namespace: str, name: str) -> dict[tuple[str, str], set[str]]:
        """{(manager, operation): the fields it owns, as the server prints paths}."""
        return {
            (o.manager, o.operation): {path_text(p) for p in o.fields}
            for o in Owner.read(self.get(plural, namespace, name))
        }

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.store.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        terms = parse_selector(selector)
        with self.lock:
            return [
                copy.deepcopy(obj)
                for (p, ns, _), obj in sorted(self.store.items())
                if p == plural
                and ns == namespace
                and selector_matches(terms, obj["metadata"].get("labels") or {})
            ]

    def writes(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] not in ("GET", "HEAD")]

    # The API semantics.

    def _next_version(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def _not_found(self, resource: Resource, name: str) -> ApiError:
        return ApiError(
            404,
            "NotFound",
            f'{resource.qualified} "{name}" not found',
            {"name": name, "group": resource.group, "kind": resource.plural}
            if resource.group
            else {"name": name, "kind": resource.plural},
        )

    def _modified(self, resource: Resource, name: str) -> ApiError:
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {resource.qualified} "{name}": the object has '
            "been modified; please apply your changes to the latest version and try again",
            {"name": name, "kind": resource.plural},
        )

    def _invalid(self, resource: Resource, name: str, field: str, message: str) -> ApiError:
        return ApiError(
            422,
            "Invalid",
            f'{resource.kind} "{name}" is invalid: {field}: {message}',
            {
                "name": name,
                "group": resource.group,
                "kind": resource.kind,
                "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
            },
        )

    def _validate(self, resource: Resource, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        if not DNS_SUBDOMAIN.match(name):
            raise self._invalid(resource, name, "metadata.name", f'Invalid value: "{name}"')
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
                raise self._invalid(
                    resource, name, "metadata.labels", f'Invalid value: "{value}" (label {key})'
                )
        for key, value in (meta.get("annotations") or {}).items():
            if not isinstance(value, str):
                raise self._invalid(resource, name, f"metadata.annotations[{key}]", "not a string")
        if resource is CONFIGMAPS:
            for key, value in (obj.get("data") or {}).items():
                if not isinstance(value, str):
                    raise self._invalid(resource, name, f"data[{key}]", "must be a string")

    def _record_update(
        self, old: dict[str, Any] | None, new: dict[str, Any], resource: Resource, manager: str
    ) -> None:
        """`new`'s managedFields after an update by `manager` of `old` (None: a create)."""
        before, after = fields_of(old or {}), fields_of(new)
        changed = {path for path, value in after.items() if before.get(path, object()) != value}
        owners = Owner.read(old)
        mine = next(
            (o for o in owners if (o.manager, o.operation) == (manager, "Update")),
            None,
        )
        if mine is None:
            mine = Owner(manager, "Update", resource.api_version, "", set())
            owners.append(mine)
        for owner in owners:
            owner.fields = {p for p in owner.fields if p in after} - (
                set() if owner is mine else changed
            )
        mine.fields |= changed
        if changed or mine.time == "":
            mine.time = now_rfc3339()
        self._write_owners(new, owners, keep=mine)

    @staticmethod
    def _write_owners(obj: dict[str, Any], owners: list[Owner], keep: Owner) -> None:
        # A manager left with no fields is dropped, as the server does (the writer's own entry
        # stays, so the time of the last write is always there).
        obj["metadata"]["managedFields"] = [o.entry() for o in owners if o.fields or o is keep]

    def create(
        self, resource: Resource, namespace: str, obj: dict[str, Any], manager: str
    ) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(
                422,
                "Invalid",
                f'{resource.kind} "" is invalid: metadata.name: Required value: name or '
                "generateName is required",
            )
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the "
                "request",
            )
        if meta.get("resourceVersion"):
            raise ApiError(
                500, "InternalError", "resourceVersion should not be set on objects to be created"
            )
        self._validate(resource, obj)
        with self.lock:
            key = (resource.plural, namespace, name)
            if key in self.store:
                details = {"name": name, "kind": resource.plural}
                if resource.group:
                    details["group"] = resource.group
                raise ApiError(
                    409, "AlreadyExists", f'{resource.qualified} "{name}" already exists', details
                )
            obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
            meta.update(
                namespace=namespace,
                uid=str(uuid.uuid4()),
                creationTimestamp=now_rfc3339(),
                resourceVersion=self._next_version(),
            )
            if resource is RAYSERVICES:
                meta["generation"] = 1
            self._record_update(None, obj, resource, manager)
            self.store[key] = obj
            return copy.deepcopy(obj)

    def update(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        new: dict[str, Any],
        manager: str,
        *,
        precondition: str | None,
        owners: tuple[list[Owner], Owner] | None = None,
    ) -> dict[str, Any]:
        """Store `new` in place of the object (the common end of replace, patch and apply);
        `owners`, from an apply, are its managedFields and the applier's entry."""
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({meta['name']}) does not match the name on the URL "
                f"({name})",
            )
        with self.lock:
            key = (resource.plural, namespace, name)
            old = self.store.get(key)
            if old is None:
                raise self._not_found(resource, name)
            old_meta = old["metadata"]
            if precondition and precondition != old_meta["resourceVersion"]:
                raise self._modified(resource, name)
            if resource is CONFIGMAPS and old.get("immutable"):
                for field in ("data", "binaryData", "immutable"):
                    if new.get(field) != old.get(field):
                        raise ApiError(
                            422,
                            "Invalid",
                            f'ConfigMap "{name}" is invalid: {field}: Forbidden: field is '
                            "immutable when `immutable` is set",
                            {
                                "name": name,
                                "kind": "ConfigMap",
                                "causes": [
                                    {
                                        "reason": "FieldValueForbidden",
                                        "message": "Forbidden: field is immutable when "
                                        "`immutable` is set",
                                        "field": field,
                                    }
                                ],
                            },
                        )
            self._validate(resource, new)
            new["apiVersion"], new["kind"] = resource.api_version, resource.kind
            # Fields the server owns keep their stored values.
            for field in ("namespace", "uid", "creationTimestamp", "generation"):
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            meta["name"] = name
            if resource is RAYSERVICES and new.get("spec") != old.get("spec"):
                meta["generation"] = old_meta.get("generation", 0) + 1
            meta["resourceVersion"] = self._next_version()
            if owners is None:
                self._record_update(old, new, resource, manager)
            else:
                self._write_owners(new, *owners)
            self.store[key] = new
            return copy.deepcopy(new)

    def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Any,
        manager: str,
    ) -> dict[str, Any]:
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
        with self.lock:
            old = self.store.get((resource.plural, namespace, name))
            if old is None:
                raise self._not_found(resource, name)
            precondition = (patch.get("metadata") or {}).get("resourceVersion")
            new = merge_patch(old, patch)
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self.update(resource, namespace, name, new, manager, precondition=precondition)

    def apply(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: Any,
        manager: str,
        *,
        force: bool = False,
    ) -> dict[str, Any]:
        """Server-side apply of `body` (a whole object) by `manager` (see the module doc)."""
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "an apply patch must be an object")
        if body.get("apiVersion") != resource.api_version or body.get("kind") != resource.kind:
            raise ApiError(
                400,
                "BadRequest",
                f"an apply patch must name apiVersion {resource.api_version} and kind "
                f"{resource.kind}",
            )
        meta = body.get("metadata") or {}
        if meta.get("name") != name:
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                f"({name})",
            )
        applied = fields_of(body)
        with self.lock:
            old = self.store.get((resource.plural, namespace, name))
            if old is None:
                created = copy.deepcopy(body)
                created["metadata"].pop("resourceVersion", None)
                created = self.create(resource, namespace, created, manager)
                stored = self.store[(resource.plural, namespace, name)]
                mine = Owner(manager, "Apply", resource.api_version, now_rfc3339(), set(applied))
                self._write_owners(stored, [mine], keep=mine)
                return copy.deepcopy(stored)
            owners = Owner.read(old)
            mine = next((o for o in owners if (o.manager, o.operation) == (manager, "Apply")), None)
            others = [o for o in owners if o is not mine]
            precondition = meta.get("resourceVersion")
            if precondition and precondition != old["metadata"]["resourceVersion"]:
                raise self._modified(resource, name)
            conflicts = [
                (owner, path)
                for owner in others
                for path in sorted(applied)
                if any(overlaps(path, theirs) for theirs in owner.fields)
                and value_at(old, path) != applied[path]
            ]
            if conflicts and not force:
                raise conflict_error(conflicts)
            for owner in others:
                owner.fields = {
                    theirs
                    for theirs in owner.fields
                    if not any(
                        overlaps(path, theirs) and value_at(old, path) != value
                        for path, value in applied.items()
                    )
                }
            new = copy.deepcopy(old)
            released = (mine.fields if mine else set()) - set(applied)
            for path in sorted(released, key=len, reverse=True):
                if not any(overlaps(path, f) for owner in others for f in owner.fields):
                    remove_at(new, path)
            for path, value in applied.items():
                set_at(new, path, value)
            if mine is None:
                mine = Owner(manager, "Apply", resource.api_version, "", set())
                owners.append(mine)
            mine.fields, mine.time = set(applied), now_rfc3339()
            return self.update(
                resource,
                namespace,
                name,
                new,
                manager,
                precondition=None,
                owners=([o for o in owners if o is mine or o in others], mine),
            )

    def delete(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.store.pop((resource.plural, namespace, name), None)
            if obj is None:
                raise self._not_found(resource, name)
            self._next_version()
            return {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "kind": resource.plural, "uid": obj["metadata"]["uid"]},
            }

    def handle(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        content_type = headers.get("content-type", "").split(";")[0].strip() or None
        self.requests.append((method, target, content_type))
        if headers.get("authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        resource, namespace, name = _route(url.path)
        verb = {
            ("GET", False): "list",
            ("GET", True): "get",
            ("POST", False): "create",
            ("PUT", True): "update",
            ("PATCH", True): "patch",
            ("DELETE", True): "delete",
        }.get((method, name is not None))
        if verb is not None:
            self.verbs.add((resource.qualified, verb))
        if verb not in resource.verbs:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the server does not allow this method on the requested resource "
                f"(not implemented by this stand-in: {method} {url.path})",
            )
        manager = query.get("fieldManager") or headers.get("user-agent", "unknown").split("/")[0]
        if verb == "list":
            items = self.list(resource.plural, namespace, query.get("labelSelector", ""))
            if not resource.group:
                # Items of a built-in list carry no kind and apiVersion of their own.
                for item in items:
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
            with self.lock:
                version = str(self.resource_version)
            return 200, {
                "kind": f"{resource.kind}List",
                "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": version},
                "items": items,
            }
        if verb == "get":
            obj = self.get(resource.plural, namespace, name)
            if obj is None:
                raise self._not_found(resource, name)
            return 200, obj
        if verb == "delete":
            return 200, self.delete(resource, namespace, name)
        force = query.get("force")
        if force not in (None, "true", "false"):
            raise ApiError(400, "BadRequest", f"force: invalid value {force!r}")
        if verb == "patch" and content_type == APPLY_PATCH:
            if not query.get("fieldManager"):
                raise ApiError(
                    422,
                    "Invalid",
                    'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is '
                    "required for apply patch",
                )
            try:
                document = yaml.safe_load(body or b"")
            except yaml.YAMLError as exc:
                raise ApiError(400, "BadRequest", f"invalid YAML body: {exc}") from None
            return 200, self.apply(
                resource, namespace, name, document, manager, force=force == "true"
            )
        if force is not None:
            raise ApiError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not be specified '
                "for non-apply patch",
            )
        # Like the real server, a create or replace without a Content-Type is read as JSON; a
        # patch must name its patch type.
        expected = MERGE_PATCH if verb == "patch" else JSON
        if (content_type or (None if verb == "patch" else JSON)) != expected:
            accepted = f"{MERGE_PATCH}, {APPLY_PATCH}" if verb == "patch" else JSON
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {accepted} (this stand-in implements no other)",
            )
        try:
            payload = json.loads(body or b"null")
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {exc}") from None
        if verb == "patch":
            return 200, self.patch(resource, namespace, name, payload, manager)
        if not isinstance(payload, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        if payload.get("kind", resource.kind) != resource.kind:
            raise ApiError(400, "BadRequest", f"expected kind {resource.kind}")
        if verb == "create":
            return 201, self.create(resource, namespace, payload, manager)
        precondition = (payload.get("metadata") or {}).get("resourceVersion")
        return 200, self.update(
            resource, namespace, name, payload, manager, precondition=precondition
        )


def _route(path: str) -> tuple[Resource, str, str | None]:
    for pattern, resource in ROUTES:
        match = pattern.match(path)
        if match:
            return resource, match["ns"], match["name"]
    raise ApiError(404, "NotFound", "the server could not find the requested resource")


def _handler_for(standin: KubeStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                code, payload = standin.handle(self.command, self.path, headers, body)
            except ApiError as exc:
                code, payload = exc.code, exc.status()
            if standin.after_request is not None:
                standin.after_request(self.command, self.path)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", JSON)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Audit-Id", str(uuid.uuid4()))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler
