"""A rendered release brought up as a cluster would run it, on real Ray processes.

`RenderedCluster` renders the chart (kuberay.harness_values), makes the pod network
(network.py) with one endpoint per Ray pod and one per client namespace the chart's values name
(KubeRay's operator, the Ingress controller, Prometheus) plus an outsider, enforces the rendered
NetworkPolicy (netpol.py), starts the head pod and then the workers as kubelet would
(kubelet.py), waits for their probes, and submits `serveConfigV2` as KubeRay does (kuberay.py).
It stands in for KubeRay, kubelet and a CNI that enforces NetworkPolicy; it cannot show
scheduling, images, persistent volumes or cluster DNS.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.cluster import kuberay, netpol
from tests.cluster.kubelet import Pod, image_env
from tests.cluster.network import Endpoint, Network
from tests.deploy.conftest import ROOT

# The namespaces the chart's default networkPolicy values name, and an outsider's.
CLIENTS = {
    "operator": "kuberay-system",
    "ingress": "ingress-nginx",
    "prometheus": "monitoring",
    "outsider": "default",
}
START_TIMEOUT_S = 240
DEPLOY_TIMEOUT_S = 600


class RenderedCluster:
    def __init__(self, root: Path, model_cache: Path, values: dict[str, Any] | None = None):
        self.root = root
        self.rendered = kuberay.render(values)
        self.values = values or kuberay.harness_values()
        self.network = Network()
        self.pods: dict[str, Pod] = {}
        self.clients: dict[str, Endpoint] = {}
        self.token = kuberay.new_token()
        self.model_cache = model_cache
        self.terminating: set[str] = set()
        self.rulesets: dict[str, str] = {}

    # -- bring-up ----------------------------------------------------------------------------

    def up(self) -> None:
        rayservice = self.rendered.rayservice
        cluster = rayservice["metadata"]["name"]
        auth = (rayservice["spec"]["rayClusterConfig"].get("authOptions") or {}).get(
            "mode"
        ) == "token"
        plans = kuberay.pod_plans(self.rendered)
        endpoints = {p.name: self.network.add(p.name, kuberay.NAMESPACE, p.labels) for p in plans}
        for name, namespace in CLIENTS.items():
            self.clients[name] = self.network.add(name, namespace, {"app": name})
        head_ip = endpoints[plans[0].name].ip
        policy = self.rendered.network_policy
        everyone = list(self.network.endpoints.values())
        for plan in plans:
            if netpol.matches(policy["spec"]["podSelector"], plan.labels):
                named = {p["name"]: p["containerPort"] for p in plan.container.get("ports", [])}
                self.rulesets[plan.name] = netpol.enforce(
                    policy, endpoints[plan.name], everyone, named
                )
        security = self.rendered.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"][
            "template"
        ]["spec"].get("securityContext", {})
        secrets = {n: self.rendered.secret_data(n) for n in self._volume_refs(plans, "secret")}
        config_maps = {
            n: self.rendered.config_map_data(n) for n in self._volume_refs(plans, "configMap")
        }
        base_env = image_env(self.model_cache)
        for plan in plans:
            env = dict(base_env)
            env |= self._container_env(plan, secrets, endpoints[plan.name].ip)
            for key, value in kuberay.kuberay_env(
                plan, cluster=cluster, head_ip=head_ip, auth=auth
            ).items():
                env.setdefault(key, value)
            if auth:
                env.setdefault("RAY_AUTH_TOKEN", self.token)
            self.pods[plan.name] = Pod(
                plan,
                endpoints[plan.name],
                self.root,
                env=env,
                config_maps=config_maps,
                secrets=secrets,
                security=security,
                model_cache=self.model_cache,
            )
        head, *workers = self.pods.values()
        head.start(head.plan.ray_start(head_ip))
        self.wait_probe(head, head.plan.readiness_commands(), "readiness")
        for pod in workers:
            pod.start(pod.plan.ray_start(head_ip))
        for pod in self.pods.values():
            startup = (pod.plan.container.get("startupProbe") or {}).get("exec")
            if startup:
                self.wait_probe(pod, [startup["command"]], "startup")
        self.operator = kuberay.Operator(
            self.clients["operator"], head_ip, self.token if auth else None
        )
        self.serve_config_now = self.rendered.serve_config
        self.operator.submit(self.serve_config_now)
        self.operator.wait_running(self.app_names(), timeout_s=DEPLOY_TIMEOUT_S)
        self.first_revision = self.request(head, stream=False)["revision"]

    # -- what KubeRay and kubelet do later ----------------------------------------------------

    def router_config(self) -> tuple[str, dict[str, str]]:
        """The router's ConfigMap: its name and data as rendered."""
        head = next(iter(self.pods.values()))
        name = next(v["configMap"]["name"] for v in head.plan.volumes if "configMap" in v)
        return name, self.rendered.config_map_data(name)

    def update_config_map(self, name: str, files: dict[str, str]) -> None:
        """kubelet's update of the ConfigMap in every pod that mounts it."""
        for pod in self.pods.values():
            for volume in pod.plan.volumes:
                if volume.get("configMap", {}).get("name") == name:
                    pod.update_volume(volume["name"], files)

    def current_serve_config(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.serve_config_now))

    def apps_on(self, pod: Pod) -> set[str]:
        """The arms' applications with a running replica on a pod."""
        return {
            name
            for name, app in self.operator.applications().items()
            if name != "specserve"
            for d in app["deployments"].values()
            for r in d["replicas"]
            if r.get("node_ip") == pod.endpoint.ip and r["state"] == "RUNNING"
        }

    def busiest_worker(self) -> Pod:
        """A worker pod that runs an arm's engine replica."""
        return next(p for p in self.pods.values() if not p.plan.head and self.apps_on(p))

    def recreate(self, pod: Pod) -> Pod:
        """KubeRay's replacement of a deleted worker pod (same group, same address here)."""
        head_ip = next(iter(self.pods.values())).endpoint.ip
        fresh = Pod(
            pod.plan,
            pod.endpoint,
            self.root / f"{pod.plan.name}-again",
            env=pod.env,
            config_maps=pod.config_maps,
            secrets=pod.secrets,
            security=pod.security,
            model_cache=self.model_cache,
        )
        fresh.start(pod.plan.ray_start(head_ip))
        self.pods[pod.plan.name] = fresh
        self.terminating.discard(pod.plan.name)
        startup = (pod.plan.container.get("startupProbe") or {}).get("exec")
        self.wait_probe(
            fresh, [startup["command"]] if startup else pod.plan.liveness_commands(), "startup"
        )
        # Not Ready until Ray Serve runs a proxy there (a replica lands on it): KubeRay's
        # readiness probe of a RayService worker checks the proxy.
        return fresh

    def arm_names(self) -> set[str]:
        return {a["name"] for a in self.values["config"]["arms"]}

    @staticmethod
    def _volume_refs(plans, kind: str) -> set[str]:
        key = "secretName" if kind == "secret" else "name"
        return {v[kind][key] for p in plans for v in p.volumes if kind in v}

    @staticmethod
    def _container_env(plan, secrets, pod_ip: str) -> dict[str, str]:
        env = {}
        for item in plan.container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            source = item["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[item["name"]] = secrets[ref["name"]][ref["key"]]
            elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[item["name"]] = pod_ip
            else:
                raise NotImplementedError(f"env {item['name']}: {source}")
        return env

    @property
    def head(self) -> Pod:
        return next(p for p in self.pods.values() if p.plan.head)

    def app_names(self) -> set[str]:
        return {app["name"] for app in self.rendered.serve_config["applications"]}

    def wait_probe(
        self, pod: Pod, commands: list[list[str]], kind: str, timeout_s: float = START_TIMEOUT_S
    ) -> None:
        deadline = time.monotonic() + timeout_s
        why = ""
        while time.monotonic() < deadline:
            ok, why = pod.probe(commands)
            if ok:
                return
            if pod.process is not None and pod.process.poll() is not None:
                raise AssertionError(f"{pod.plan.name} exited: {pod.log.read_text()[-3000:]}")
            time.sleep(2)
        raise AssertionError(
            f"{pod.plan.name}: {kind} probe failing after {timeout_s:.0f} s: {why}"
        )

    # -- clients ---------------------------------------------------------------------------

    def api_url(self, pod: Pod) -> str:
        return f"http://{pod.endpoint.ip}:{kuberay.SERVE_PORT}/v1"

    def serving_pods(self) -> list[Pod]:
        """The API Service's endpoints: pods not being deleted whose readiness probe passes (a
        worker's checks its Serve proxy, which runs only on nodes with replicas). KubeRay
        decides the head's by its own check of the same proxy."""
        return [
            p
            for n, p in self.pods.items()
            if n not in self.terminating and p.probe(self.serve_readiness(p))[0]
        ]

    @staticmethod
    def serve_readiness(pod: Pod) -> list[list[str]]:
        if pod.plan.head:
            return [
                ["bash", "-c", f"wget -T 10 -q -O- http://localhost:{kuberay.SERVE_PORT}/-/healthz"]
            ]
        return pod.plan.readiness_commands()

    def api_key(self, *, admin: bool = False) -> str:
        """The chart's API key, or its admin key (which is told the arm that answered), from the
        Secret of the keys it drew, which no pod mounts (the pods hold their digests)."""
        files = self.rendered.secret_data(self.keys_secret_name() + "-issued")
        rows = files["admin-keys" if admin else "api-keys"].splitlines()
        line = next(row for row in rows if row.strip() and row[0] != "#")
        return line.split("=", 1)[1] if "=" in line else line

    def keys_secret_name(self) -> str:
        head = next(iter(self.pods.values()))
        return next(v["secret"]["secretName"] for v in head.plan.volumes if "secret" in v)

    def request(self, pod: Pod, *, stream: bool, client: str = "ingress") -> dict:
        done = self.client_run(
            client,
            "one",
            self.api_url(pod),
            self.api_key(admin=True),  # the tests read which arm answered (routing.arm_header)
            self.model(),
            "stream" if stream else "plain",
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def model(self) -> str:
        return self.values["config"]["model"]["name"]

    def client_run(
        self, client: str, *args: str, timeout: float = 240
    ) -> subprocess.CompletedProcess:
        return self.clients[client].run(
            sys.executable,
            "-m",
            "tests.cluster.client",
            *args,
            timeout=timeout,
            env=self._client_env(),
        )

    def client_popen(self, client: str, *args: str) -> subprocess.Popen:
        argv = [
            "ip",
            "netns",
            "exec",
            self.clients[client].netns,
            sys.executable,
            "-m",
            "tests.cluster.client",
            *args,
        ]
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self._client_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @staticmethod
    def _client_env() -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/tmp", "NO_PROXY": "*"}

    def curl(self, client: str, url: str, timeout_s: float = 3) -> int:
        """The HTTP status a client gets from url; 0 when no connection is made in time."""
        done = self.clients[client].run(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", str(timeout_s), url,
            timeout=timeout_s + 5,
        )  # fmt: skip
        return int(done.stdout or 0)

    # -- tear-down -------------------------------------------------------------------------

    def close(self) -> None:
        for pod in self.pods.values():
            pod.kill()
        self.network.close()

    def describe(self) -> str:
        """What a failing test shows: each pod's log tail."""
        return "\n".join(
            f"--- {n}\n{p.log.read_text()[-1500:] if p.log.exists() else ''}"
            for n, p in self.pods.items()
        )
