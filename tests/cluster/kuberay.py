"""KubeRay's part, played from the rendered chart: the pods it would create from the RayService,
and the calls it makes to the head's dashboard.

From the RayService's head group and worker groups this builds each Ray pod as KubeRay v1.7
builds it (ray-operator/controllers/ray/common/pod.go): the container's rendered env plus the
variables KubeRay adds (the Ray token from its Secret, RAY_ADDRESS, the RayService timeouts,
...), the `ray start` command it generates from rayStartParams (`--block`, the metrics export
and dashboard agent ports, `--memory` from the container's limit, `--address` for workers), and
its default liveness and readiness probes for Ray >= 2.53 (the dashboard agent's `/api/healthz`;
a RayService worker's readiness also checks the Serve proxy's `/-/healthz`). The head's
Service name is replaced by the head pod's address (no cluster DNS here).

It then does what the RayService controller does: PUT `serveConfigV2` (as JSON) to the Serve REST
API on the head's dashboard port with the token (`x-ray-authorization: Bearer`), and read the
applications' status from the same API until every one is RUNNING.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from tests.deploy.conftest import generate

RELEASE = "specserve"
NAMESPACE = "llm"
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
METRICS_PORT = 8080
AGENT_PORT = 52365
GCS_PORT = 6379
# What the harness clusters run: two cheap arms, one engine per worker pod and a spare pod for
# the replicas of a deleted one; requests end within a minute, so a drain fits in the grace.
REQUEST_TIMEOUT_S = 120
# A redeployed arm: Ray Serve builds it again and starts its engine (about a minute, loaded).
REDEPLOY_TIMEOUT_S = 300


@dataclass
class PodPlan:
    """One Ray pod as KubeRay would create it."""

    name: str
    group: str  # "head" or the worker group's name
    labels: dict[str, str]
    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    start_params: dict[str, str]
    grace_s: float
    env: dict[str, str] = field(default_factory=dict)  # resolved: rendered + KubeRay's
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (secret, key)

    @property
    def head(self) -> bool:
        return self.group == "head"

    def ray_start(self, head_ip: str) -> str:
        """KubeRay's generated container command (bash -c; the image's login shell keeps PATH)."""
        params = dict(self.start_params)
        if not self.head:
            params.setdefault("address", f"{head_ip}:{GCS_PORT}")
        else:
            params.setdefault("dashboard-host", "0.0.0.0")
        params.setdefault("metrics-export-port", str(METRICS_PORT))
        params["block"] = "true"
        params.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
        limits = self.container.get("resources", {}).get("limits", {})
        if "num-cpus" not in params and "cpu" in limits:
            params["num-cpus"] = str(int(float(str(limits["cpu"]))))
        if "memory" not in params and "memory" in limits:
            params["memory"] = str(quantity_bytes(str(limits["memory"])))
        flags = []
        for key in sorted(params):
            value = str(params[key])
            if value.lower() == "true":
                flags.append(f"--{key}")
            elif value.lower() != "false":
                flags.append(f"--{key}={value}")
        kind = "ray start --head" if self.head else "ray start"
        return f"ulimit -n 65536; {kind} {' '.join(flags)}"

    def readiness_commands(self) -> list[list[str]]:
        """KubeRay's default readiness probe (Ray >= 2.53), as commands run in the pod."""
        healthz = ["wget", "--tries", "1", "-T", "2", "-q", "-O-"]
        checks = [[*healthz, f"http://localhost:{AGENT_PORT}/api/healthz"]]
        if not self.head:  # a RayService worker also serves traffic through its proxy
            checks.append(
                [
                    "bash",
                    "-c",
                    f"wget --tries 1 -T 10 -q -O- http://localhost:{SERVE_PORT}/-/healthz"
                    " | grep success",
                ]
            )
        return checks

    def liveness_commands(self) -> list[list[str]]:
        return [
            [
                "wget",
                "--tries",
                "1",
                "-T",
                "2",
                "-q",
                "-O-",
                f"http://localhost:{AGENT_PORT}/api/healthz",
            ]
        ]


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


def harness_values() -> dict[str, Any]:
    """The CPU profile's values with the small override the harness runs: two arms, three worker
    pods (two engines and a spare), a short request timeout."""
    defaults = yaml.safe_load((generate.CHART / "values.yaml").read_text())
    arms = [a for a in defaults["config"]["arms"] if a["name"] in ("no-spec", "ngram")]
    for arm in arms:
        arm["weight"] = 50
    group = dict(defaults["workerGroups"][0])
    group.update(replicas=3, minReplicas=3, maxReplicas=3)
    config = dict(defaults["config"])
    config["arms"] = arms
    config["limits"] = {**config["limits"], "request_timeout_s": REQUEST_TIMEOUT_S}
    return {"config": config, "workerGroups": [group]}


@dataclass
class Rendered:
    objects: list[dict[str, Any]]

    def one(self, kind: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind]
        assert len(found) == 1, f"{len(found)} {kind} objects rendered"
        return found[0]

    @property
    def rayservice(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    def config_map_data(self, name: str) -> dict[str, str]:
        return self._named("ConfigMap", name).get("data") or {}

    def secret_data(self, name: str) -> dict[str, str]:
        secret = self._named("Secret", name)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        return {**data, **(secret.get("stringData") or {})}

    def _named(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert found, f"no {kind} {name} rendered"
        return found[0]

    @property
    def network_policy(self) -> dict[str, Any]:
        policy = self.one("NetworkPolicy")
        policy["metadata"].setdefault("namespace", NAMESPACE)
        return policy


def render(values: dict[str, Any] | None = None) -> Rendered:
    manifests = generate.render(values or harness_values(), name=RELEASE, namespace=NAMESPACE)
    return Rendered(generate.objects(manifests))


def pod_plans(rendered: Rendered) -> list[PodPlan]:
    """The head pod and every worker group's pods, as KubeRay creates them."""
    spec = rendered.rayservice["spec"]["rayClusterConfig"]
    cluster = rendered.rayservice["metadata"]["name"]
    groups = [("head", 1, spec["headGroupSpec"])]
    groups += [(g["groupName"], g["replicas"], g) for g in spec.get("workerGroupSpecs", [])]
    plans = []
    for group, replicas, group_spec in groups:
        template = group_spec["template"]
        for index in range(replicas):
            name = f"{cluster}-head" if group == "head" else f"{cluster}-{group}-{index}"
            labels = {
                **template["metadata"].get("labels", {}),
                "ray.io/cluster": cluster,
                "ray.io/group": group if group != "head" else "headgroup",
                "ray.io/node-type": "head" if group == "head" else "worker",
            }
            pod_spec = template["spec"]
            plans.append(
                PodPlan(
                    name=name,
                    group=group,
                    labels=labels,
                    container=pod_spec["containers"][0],
                    volumes=pod_spec.get("volumes", []),
                    start_params={k: str(v) for k, v in group_spec["rayStartParams"].items()},
                    grace_s=float(pod_spec.get("terminationGracePeriodSeconds", 30)),
                )
            )
    return plans


def kuberay_env(plan: PodPlan, *, cluster: str, head_ip: str, auth: bool) -> dict[str, str]:
    """The variables KubeRay adds to the Ray container (those not set already)."""
    env = {
        "RAY_CLUSTER_NAME": cluster,
        "RAY_CLOUD_INSTANCE_ID": plan.name,
        "RAY_NODE_TYPE_NAME": plan.labels["ray.io/group"],
        "KUBERAY_GEN_RAY_START_CMD": plan.ray_start(head_ip).split("; ", 1)[1],
        "RAY_PORT": str(GCS_PORT),
        "RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO": "0",
        "RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS": "5",
        "RAY_SERVE_KV_TIMEOUT_S": "5",
        "RAY_ADDRESS": f"{'127.0.0.1' if plan.head else head_ip}:{GCS_PORT}",
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
    }
    if not plan.head:
        env |= {"FQ_RAY_IP": head_ip, "RAY_IP": head_ip}
    if auth:
        env["RAY_AUTH_MODE"] = "token"
    return env


def new_token() -> str:
    return secrets.token_hex(16)  # KubeRay's token Secret holds a random string


class Operator:
    """The RayService controller's calls to the head's dashboard, from the operator's pod."""

    def __init__(self, endpoint, head_ip: str, token: str | None) -> None:
        self.endpoint, self.url, self.token = endpoint, f"http://{head_ip}:{DASHBOARD_PORT}", token

    def _curl(self, method: str, path: str, body: str | None = None, timeout: float = 30):
        argv = ["curl", "-sS", "-m", str(int(timeout)), "-X", method, "-w", "\n%{http_code}"]
        if self.token:
            argv += ["-H", f"x-ray-authorization: Bearer {self.token}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", body]
        done = self.endpoint.run(*argv, self.url + path, timeout=timeout + 5)
        text, _, code = done.stdout.rpartition("\n")
        return int(code or 0), text

    def submit(self, serve_config: dict[str, Any]) -> None:
        status, text = self._curl("PUT", "/api/serve/applications/", json.dumps(serve_config))
        assert status == 200, f"serveConfigV2 refused: {status} {text[:500]}"

    def details(self) -> dict[str, Any]:
        """Serve's details: the applications and the HTTP proxies."""
        status, text = self._curl("GET", "/api/serve/applications/")
        assert status == 200, f"{status} {text[:300]}"
        return json.loads(text)

    def applications(self) -> dict[str, Any]:
        return self.details().get("applications") or {}

    def proxy_ips(self) -> set[str]:
        """Addresses of the nodes that run a Serve HTTP proxy: the head and every node with a
        replica."""
        proxies = (self.details().get("proxies") or {}).values()
        return {p["node_ip"] for p in proxies if p.get("status") == "HEALTHY"}

    def wait_running(self, names: set[str], *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        apps: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                apps = self.applications()
            except (AssertionError, json.JSONDecodeError):
                apps = {}
            statuses = {n: (apps.get(n) or {}).get("status") for n in names}
            if all(s == "RUNNING" for s in statuses.values()):
                return apps
            failed = {
                n: apps[n].get("message") for n, s in statuses.items() if s == "DEPLOY_FAILED"
            }
            assert not failed, f"applications failed to deploy: {failed}"
            time.sleep(2)
        raise AssertionError(f"not RUNNING within {timeout_s:.0f} s: {statuses}")
