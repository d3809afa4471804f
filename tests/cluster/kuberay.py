"""KubeRay's part, played from the rendered chart: the pods it would create from the RayService,
and the calls it makes to the head's dashboard.

From the RayService's head group and worker groups this builds each Ray pod as KubeRay v1.7
builds it (ray-operator/controllers/ray/common/pod.go): the container's rendered env plus the
variables KubeRay adds (the Ray token from its Secret, RAY_ADDRESS, the RayService timeouts,
...), the `ray start` command it generates from rayStartParams (`--block`, the metrics export
and dashboard agent ports, `--memory` from the container's limit, `--address` for workers), and
its default liveness and readiness probes for Ray >= 2.53 with their timeouts and thresholds
(`PodPlan.probes`), and names each pod as the API server does for KubeRay's `generateName` (a
random suffix: a replaced pod has a new name, and a new address from the pod network). Workers
reach the head by its Service's name (cluster DNS: network.py's hosts file).

It then does what the RayService controller does: PUT `serveConfigV2` (as JSON) to the Serve REST
API on the head's dashboard port with the token (`x-ray-authorization: Bearer`), and read the
applications' status from the same API until every one is RUNNING. For an upgrade it compares
the RayService's cluster spec as KubeRay does (`cluster_spec_hash`) and names a new RayCluster
(`new_cluster_name`); harness.py's `sync` and `roll` act on them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes.utils import parse_quantity

from tests.deploy.conftest import generate

RELEASE = "specserve"
NAMESPACE = "llm"
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
METRICS_PORT = 8080
AGENT_PORT = 52365
GCS_PORT = 6379
# The characters the API server draws a generated name's suffix from (apiserver's names.go).
NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# KubeRay's probe timeouts (utils/constant.go): the head's queries two checks.
PROBE_TIMEOUT_S = 2.0
HEAD_PROBE_TIMEOUT_S = 5.0
# The external Redis of GCS fault tolerance: a pod of the release's namespace.
REDIS_HOST = f"redis.{NAMESPACE}.svc.cluster.local"
REDIS_PORT = 6379
REDIS_SELECTOR = {"matchLabels": {"app": "redis"}}
# How long a load client may take to end its streams once told to stop: a request waiting for a
# replica may take the whole of client.REQUEST_TIMEOUT_S (420 s).
LOAD_STOP_S = 450
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
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # resolved: rendered + KubeRay's
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (secret, key)

    @property
    def head(self) -> bool:
        return self.group == "head"

    def ray_start(self, head_host: str) -> str:
        """KubeRay's generated container command (bash -c; the image's login shell keeps PATH).
        A worker joins the head through its Service's name."""
        params = dict(self.start_params)
        if not self.head:
            params.setdefault("address", f"{head_host}:{GCS_PORT}")
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

    def probes(self) -> dict[str, Probe]:
        """The container's probes as kubelet runs them: those rendered, and where the chart sets
        none, the liveness and readiness probes KubeRay v1.7 injects for Ray >= 2.53
        (pod.go `initLivenessAndReadinessProbe`, utils/constant.go): an HTTP GET of the
        dashboard agent's `/api/healthz` from the node, except a RayService worker's readiness,
        an exec of the agent's raylet check and the Serve proxy's, which fails the pod at once."""
        timeout = HEAD_PROBE_TIMEOUT_S if self.head else PROBE_TIMEOUT_S
        healthz = {"http_port": AGENT_PORT, "http_path": "/api/healthz"}
        probes = {
            "liveness": Probe(
                "liveness", **healthz, timeout_s=timeout, initial_delay_s=30,
                failure_threshold=120,
            ),
            "readiness": Probe(
                "readiness", **healthz, timeout_s=timeout, initial_delay_s=10,
                failure_threshold=10,
            ),
        }  # fmt: skip
        if not self.head:
            checks = [
                f"wget -T {int(PROBE_TIMEOUT_S)} -q -O- "
                f"http://localhost:{AGENT_PORT}/api/local_raylet_healthz | grep success",
                # KubeRay passes the readiness probe's initial delay (10) as this wget's timeout
                f"wget -T 10 -q -O- http://localhost:{self.serve_port}/-/healthz | grep success",
            ]
            probes["readiness"] = Probe(
                "readiness", command=["bash", "-c", " && ".join(checks)], timeout_s=timeout,
                initial_delay_s=10, failure_threshold=1,
            )  # fmt: skip
        for kind in ("liveness", "readiness", "startup"):
            rendered = self.container.get(f"{kind}Probe")
            if rendered:
                probes[kind] = Probe.rendered(kind, rendered)
        return probes

    @property
    def serve_port(self) -> int:
        ports = {p.get("name"): p["containerPort"] for p in self.container.get("ports", [])}
        return int(ports.get("serve", SERVE_PORT))


@dataclass(frozen=True)
class Probe:
    """One probe of a container: an HTTP GET kubelet makes from the node to the pod's address,
    or a command run in the container; failing `failure_threshold` times in a row (every
    `period_s`, each given `timeout_s`) makes the pod NotReady (readiness) or restarts the
    container (liveness, startup)."""

    kind: str
    timeout_s: float
    initial_delay_s: float
    failure_threshold: int
    period_s: float = 5
    http_port: int | None = None
    http_path: str = "/"
    command: list[str] | None = None

    @classmethod
    def rendered(cls, kind: str, spec: dict[str, Any]) -> Probe:
        """A probe as the pod spec writes it, with Kubernetes' defaults."""
        common = {
            "timeout_s": float(spec.get("timeoutSeconds", 1)),
            "initial_delay_s": float(spec.get("initialDelaySeconds", 0)),
            "failure_threshold": int(spec.get("failureThreshold", 3)),
            "period_s": float(spec.get("periodSeconds", 10)),
        }
        if "exec" in spec:
            return cls(kind, command=list(spec["exec"]["command"]), **common)
        if "httpGet" in spec:
            http = spec["httpGet"]
            return cls(kind, http_port=int(http["port"]), http_path=http.get("path", "/"), **common)
        raise NotImplementedError(f"{kind} probe {sorted(spec)} not played here")


def quantity_bytes(text: str) -> int:
    return int(parse_quantity(text))


def harness_values() -> dict[str, Any]:
    """The CPU profile's values with the overrides the harness runs: two of its arms (the cheap
    ones), as many worker pods as the profile has per arm, its spare included, and GCS fault
    tolerance with an external Redis (off by default; the head's deletion is tested with it).
    Its request timeout, drain and probes are the profile's."""
    defaults = yaml.safe_load((generate.CHART / "values.yaml").read_text())
    arms = [a for a in defaults["config"]["arms"] if a["name"] in ("no-spec", "ngram")]
    for arm in arms:
        arm["weight"] = 50
    group = dict(defaults["workerGroups"][0])
    spare = group["replicas"] - len(defaults["config"]["arms"])  # one engine per pod and arm
    pods = len(arms) + spare
    group.update(replicas=pods, minReplicas=pods, maxReplicas=pods)
    config = dict(defaults["config"])
    config["arms"] = arms
    # GCS fault tolerance on, with its Redis in the release's namespace.
    redis = {
        "redisAddress": f"{REDIS_HOST}:{REDIS_PORT}",
        "redisTo": [{"podSelector": REDIS_SELECTOR}],
    }
    ray = {**defaults["ray"], "gcsFaultTolerance": redis}
    return {"config": config, "workerGroups": [group], "ray": ray}


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


def pod_plans(rayservice: dict[str, Any], cluster: str | None = None) -> list[PodPlan]:
    """The head pod and every worker group's pods of a RayService's cluster (named `cluster`,
    by default as the RayService), as KubeRay creates them."""
    spec = rayservice["spec"]["rayClusterConfig"]
    cluster = cluster or rayservice["metadata"]["name"]
    groups = [("head", 1, spec["headGroupSpec"])]
    groups += [(g["groupName"], g["replicas"], g) for g in spec.get("workerGroupSpecs", [])]
    plans = []
    for group, replicas, group_spec in groups:
        template = group_spec["template"]
        for _ in range(replicas):
            name = pod_name(cluster, group)
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
                    init_containers=pod_spec.get("initContainers", []),
                )
            )
    return plans


def pod_name(cluster: str, group: str) -> str:
    """A new pod's name: KubeRay's generateName prefix and the API server's random suffix."""
    prefix = f"{cluster}-head-" if group == "head" else f"{cluster}-{group}-worker-"
    return prefix + "".join(secrets.choice(NAME_SUFFIX_ALPHABET) for _ in range(5))


def new_cluster_name(rayservice: dict[str, Any]) -> str:
    """A RayCluster KubeRay creates for a RayService's upgrade: its name and a random suffix."""
    suffix = "".join(secrets.choice(NAME_SUFFIX_ALPHABET) for _ in range(5))
    return f"{rayservice['metadata']['name']}-{suffix}"


def cluster_spec_hash(rayservice: dict[str, Any]) -> str:
    """What KubeRay compares to decide whether a RayService's cluster must be upgraded
    (rayservice_controller.go `generateHashWithoutReplicasAndWorkersToDelete`): the cluster
    spec without the worker groups' replica counts, which it applies in place."""
    spec = json.loads(json.dumps(rayservice["spec"]["rayClusterConfig"]))
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def upgrade_strategy(rayservice: dict[str, Any]) -> str:
    """The RayService's upgrade strategy; KubeRay's default is NewCluster."""
    return (rayservice["spec"].get("upgradeStrategy") or {}).get("type") or "NewCluster"


def head_service_host(cluster: str) -> str:
    """The head Service's name in cluster DNS, which KubeRay gives workers as the head's
    address (FQ_RAY_IP)."""
    return f"{cluster}-head-svc.{NAMESPACE}.svc.cluster.local"


def kuberay_env(
    plan: PodPlan, *, cluster: str, auth: bool, gcs_ft: dict[str, Any] | None, storage: str
) -> dict[str, str]:
    """The variables KubeRay adds to the Ray container (those not set already); with GCS fault
    tolerance (`gcs_ft`, the RayCluster's gcsFaultToleranceOptions), the head's Redis address
    and storage namespace (the RayCluster's UID, `storage`) and the workers' 600 s to
    reconnect to a restarted GCS (pod.go `configureGCSFaultTolerance`)."""
    head_host = head_service_host(cluster)
    env = {
        "RAY_CLUSTER_NAME": cluster,
        "RAY_CLOUD_INSTANCE_ID": plan.name,
        "RAY_NODE_TYPE_NAME": plan.labels["ray.io/group"],
        "KUBERAY_GEN_RAY_START_CMD": plan.ray_start(head_host).split("; ", 1)[1],
        "RAY_PORT": str(GCS_PORT),
        "RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO": "0",
        "RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS": "5",
        "RAY_SERVE_KV_TIMEOUT_S": "5",
        "RAY_ADDRESS": f"{'127.0.0.1' if plan.head else head_host}:{GCS_PORT}",
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
    }
    if not plan.head:
        env |= {"FQ_RAY_IP": head_host, "RAY_IP": head_host}
    if auth:
        env["RAY_AUTH_MODE"] = "token"
    if gcs_ft and plan.head:
        env |= {
            "RAY_REDIS_ADDRESS": gcs_ft["redisAddress"],
            "RAY_external_storage_namespace": storage,
        }
    elif gcs_ft:
        env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "600"
    return env


def new_token() -> str:
    return secrets.token_hex(16)  # KubeRay's token Secret holds a random string


class Operator:
    """The RayService controller's calls to the head's dashboard, from the operator's pod."""

    def __init__(self, endpoint, head_ip: str, token: str | None) -> None:
        self.endpoint, self.token = endpoint, token
        self.follow(head_ip)

    def follow(self, head_ip: str) -> None:
        """Talk to the head at this address (the head Service's endpoint, after a new head)."""
        self.url = f"http://{head_ip}:{DASHBOARD_PORT}"

    def reconcile(self, serve_config: dict[str, Any], *, timeout_s: float) -> bool:
        """The RayService controller's check once the head is Ready, retried until the head's
        Serve API answers: the Serve config is submitted again when the cluster runs no
        application (a head that came back without its state); with GCS fault tolerance the
        applications come back by themselves. Returns whether it submitted."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                apps = self.applications()
                break
            except (AssertionError, json.JSONDecodeError):
                assert time.monotonic() < deadline, f"no answer from {self.url} in {timeout_s} s"
                time.sleep(2)
        if apps:
            return False
        self.submit(serve_config)
        return True

    def _curl(self, method: str, path: str, body: str | None = None, timeout: float = 30):
        argv = ["curl", "-sS", "-m", str(int(timeout)), "-X", method, "-w", "\n%{http_code}"]
        if self.token:
            argv += ["-H", f"x-ray-authorization: Bearer {self.token}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", body]
        try:
            # The margin: `ip netns exec` and curl's own start on two cores two clusters share.
            done = self.endpoint.run(*argv, self.url + path, timeout=timeout + 15)
        except subprocess.TimeoutExpired:  # no answer in time, as KubeRay's client would see it
            return 0, ""
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

    def nodes(self) -> set[tuple[str, str]]:
        """(address, state) of every Ray node the GCS knows (the state API)."""
        status, text = self._curl("GET", "/api/v0/nodes?limit=100")
        if status != 200:
            return set()
        rows = json.loads(text)["data"]["result"]["result"]
        return {(row["node_ip"], row["state"]) for row in rows}

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
