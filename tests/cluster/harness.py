"""A rendered release brought up as a cluster would run it, on real Ray processes.

`RenderedCluster` renders the chart (kuberay.harness_values), makes the pod network
(network.py) with one endpoint per Ray pod and one per client namespace the chart's values name
(KubeRay's operator, the Ingress controller, Prometheus) plus an outsider and the Redis of GCS
fault tolerance, enforces the rendered NetworkPolicy (netpol.py), starts the head pod and then
the workers as kubelet would (kubelet.py), waits for their probes, and submits `serveConfigV2`
as KubeRay does (kuberay.py). Later it deletes pods and replaces them (new names, new
addresses; a new head takes over the head Service's name), and follows the release's objects in
the API (release.py) as kubelet and KubeRay do (`sync`): a ConfigMap's new files, a Serve config
applied in place, a cluster spec rolled to a new cluster under NewCluster (`roll`). It stands in
for KubeRay, kubelet, cluster DNS (a hosts file) and a CNI that enforces NetworkPolicy; it cannot
show scheduling, images or persistent volumes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from specserve.config.serve_config import ROUTER_APP_NAME
from tests.cluster import kuberay, netpol
from tests.cluster.kubelet import Pod, image_env
from tests.cluster.network import ClusterDNS, Endpoint, Network
from tests.cluster.release import Release
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
        self.tokens: dict[str, str] = {}  # by RayCluster: KubeRay's token Secret is its own
        self.model_cache = model_cache
        self.terminating: set[str] = set()
        self.rulesets: dict[str, str] = {}
        self.dns = ClusterDNS(root / "hosts")
        self.redis: subprocess.Popen | None = None
        self.release: Release | None = None

    # -- bring-up ----------------------------------------------------------------------------

    def up(self) -> None:
        rayservice = self.rendered.rayservice
        self.cluster_name = rayservice["metadata"]["name"]
        cluster_spec = rayservice["spec"]["rayClusterConfig"]
        self.auth = (cluster_spec.get("authOptions") or {}).get("mode") == "token"
        self.exclude_head = bool(rayservice["spec"].get("excludeHeadPodFromServeSvc"))
        self.gcs_ft = cluster_spec.get("gcsFaultToleranceOptions")
        # Each RayCluster's UID: its GCS's namespace in Redis.
        self.storages = {self.cluster_name: str(uuid.uuid4())}
        self.tokens[self.cluster_name] = kuberay.new_token()
        self.cluster_spec = kuberay.cluster_spec_hash(rayservice)
        (self.root / "api").mkdir(exist_ok=True)
        self.release = Release(self.root / "api", self.values, self.rendered.objects)
        plans = kuberay.pod_plans(rayservice)
        self.templates = {p.group: p for p in plans}
        endpoints = {p.name: self.network.add(p.name, kuberay.NAMESPACE, p.labels) for p in plans}
        for name, namespace in CLIENTS.items():
            self.clients[name] = self.network.add(name, namespace, {"app": name})
        self.head_ip = endpoints[plans[0].name].ip
        self.dns.set(kuberay.head_service_host(self.cluster_name), self.head_ip)
        if self.gcs_ft:
            self._start_redis()
        self.policy = self.rendered.network_policy
        self.security = cluster_spec["headGroupSpec"]["template"]["spec"].get("securityContext", {})
        self.secrets = {n: self.rendered.secret_data(n) for n in self._volume_refs(plans, "secret")}
        self.config_maps = {
            n: self.rendered.config_map_data(n) for n in self._volume_refs(plans, "configMap")
        }
        for plan in plans:
            self.pods[plan.name] = self._pod(plan, endpoints[plan.name])
        self.enforce_policy()
        head, *workers = self.pods.values()
        self._start(head)
        self.wait_until(lambda: head.prober.ready, f"{head.plan.name} Ready", START_TIMEOUT_S)
        for pod in workers:
            self._start(pod)
        for pod in workers:
            self.wait_until(lambda p=pod: p.prober.started, f"{pod.plan.name} started")
        self.operator = kuberay.Operator(self.clients["operator"], self.head_ip, self.token)
        # What KubeRay last took from the RayService, and what the cluster runs now.
        self.serve_config_taken = self.serve_config_now = self.rendered.serve_config
        self.operator.submit(self.serve_config_now)
        self.operator.wait_running(self.app_names(), timeout_s=DEPLOY_TIMEOUT_S)
        self.first_revision = self.request(self.wait_serving(1)[0], stream=False)["revision"]

    def _pod(self, plan: kuberay.PodPlan, endpoint: Endpoint) -> Pod:
        """A pod as kubelet sets it up: its env (rendered, KubeRay's, the image's), volumes and
        user."""
        env = image_env(self.model_cache)
        env |= self._container_env(plan, self.secrets, endpoint.ip)
        cluster = plan.labels["ray.io/cluster"]
        added = kuberay.kuberay_env(
            plan,
            cluster=cluster,
            auth=self.auth,
            gcs_ft=self.gcs_ft,
            storage=self.storages[cluster],
        )
        for key, value in added.items():
            env.setdefault(key, value)
        if self.auth:
            env.setdefault("RAY_AUTH_TOKEN", self.tokens[cluster])
        return Pod(
            plan,
            endpoint,
            self.root,
            env=env,
            config_maps=self.config_maps,
            secrets=self.secrets,
            security=self.security,
            model_cache=self.model_cache,
            hosts=self.dns.path,
        )

    def _start(self, pod: Pod) -> None:
        pod.start(pod.plan.ray_start(kuberay.head_service_host(pod.plan.labels["ray.io/cluster"])))
        pod.start_probing()

    def _start_redis(self) -> None:
        """The external Redis of GCS fault tolerance: Debian's redis-server, a pod of the
        release's namespace that the NetworkPolicy does not select, reached by its Service's
        name."""
        labels = dict(kuberay.REDIS_SELECTOR["matchLabels"])
        redis = self.network.add("redis", kuberay.NAMESPACE, labels)
        self.dns.set(kuberay.REDIS_HOST, redis.ip)
        port = str(kuberay.REDIS_PORT)
        argv = ["ip", "netns", "exec", redis.netns, "redis-server", "--port", port,
                "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no",
                "--dir", str(self.root)]  # fmt: skip
        log = (self.root / "redis.log").open("ab")
        self.redis = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def enforce_policy(self) -> None:
        """The NetworkPolicy's rules in every pod it selects, for the pods that exist now."""
        everyone = list(self.network.endpoints.values())
        for pod in self.pods.values():
            if netpol.matches(self.policy["spec"]["podSelector"], pod.plan.labels):
                ports = pod.plan.container.get("ports", [])
                named = {p["name"]: p["containerPort"] for p in ports}
                self.rulesets[pod.plan.name] = netpol.enforce(
                    self.policy, pod.endpoint, everyone, named, self.network.gateway
                )

    def wait_until(self, condition, what: str, timeout_s: float = START_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while not (found := condition()):
            crashing = [p for p in self.pods.values() if p.prober and len(p.prober.exits) >= 3]
            if crashing:  # kubelet's CrashLoopBackOff
                pod = crashing[0]
                raise AssertionError(
                    f"{pod.plan.name} keeps exiting: {pod.log.read_text()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
            time.sleep(1)
        return found

    # -- what KubeRay and kubelet do later ----------------------------------------------------

    def router_config(self) -> tuple[str, dict[str, str]]:
        """The router's ConfigMap: its name and the files the pods have now."""
        head = next(iter(self.pods.values()))
        name = next(v["configMap"]["name"] for v in head.plan.volumes if "configMap" in v)
        return name, dict(self.config_maps[name])

    def update_config_map(self, name: str, files: dict[str, str]) -> None:
        """kubelet's update of the ConfigMap in every pod that mounts it."""
        self.config_maps[name] = dict(files)
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
            if name != ROUTER_APP_NAME
            for d in app["deployments"].values()
            for r in d["replicas"]
            if r.get("node_ip") == pod.endpoint.ip and r["state"] == "RUNNING"
        }

    def busiest_worker(self) -> Pod:
        """A worker pod that runs an arm's engine replica."""
        return next(p for p in self.pods.values() if not p.plan.head and self.apps_on(p))

    def delete(self, pod: Pod) -> dict[str, float]:
        """A pod deleted as on a cluster: out of the Service's endpoints first, then kubelet's
        deletion (preStop, SIGTERM, the grace period), then its sandbox and address go and the
        NetworkPolicy's rules forget it. Returns how long each part took."""
        self.terminating.add(pod.plan.name)
        took = pod.delete()
        del self.pods[pod.plan.name]
        self.network.remove(pod.plan.name)
        self.rulesets.pop(pod.plan.name, None)
        self.enforce_policy()
        return took

    def recreate(self, group: str) -> Pod:
        """KubeRay's replacement of a deleted pod: the group's template, a new name and a new
        address; Started once its startup probe passes. A worker is Ready (an endpoint of the
        API Service) only once Ray Serve runs a proxy there, when a replica lands on it. A new
        head takes over the head Service's name (cluster DNS) and the operator's calls."""
        template = self.templates[group]
        plan = dataclasses.replace(template, name=kuberay.pod_name(self.cluster_name, group))
        endpoint = self.network.add(plan.name, kuberay.NAMESPACE, plan.labels)
        if plan.head:
            self.head_ip = endpoint.ip
            self.dns.set(kuberay.head_service_host(self.cluster_name), endpoint.ip)
            self.operator.follow(endpoint.ip)
        fresh = self.pods[plan.name] = self._pod(plan, endpoint)
        self.enforce_policy()
        self._start(fresh)
        self.wait_until(lambda: fresh.prober.started, f"{plan.name} started")
        return fresh

    # -- the release's objects in the API, followed ----------------------------------------

    def sync(self, on_switch=None) -> list[str]:
        """What kubelet and KubeRay do with the release's objects in the API now; returns it in
        words. kubelet writes the live ConfigMap's files into every pod that mounts it. KubeRay
        compares the RayService's cluster spec with the running cluster's: changed, it rolls a
        new cluster under NewCluster (`roll`, `on_switch` as there) and leaves it unapplied
        under None. A changed serveConfigV2 goes to the cluster that serves, in place (Ray
        Serve redeploys the applications whose config changed)."""
        assert self.release is not None
        done = []
        config_map = self.release.config_map()
        name = config_map["metadata"]["name"]
        if (config_map.get("data") or {}) != self.config_maps.get(name):
            self.update_config_map(name, config_map.get("data") or {})
            done.append("ConfigMap files updated")
        rayservice = self.release.rayservice()
        document = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
        if kuberay.cluster_spec_hash(rayservice) != self.cluster_spec:
            if kuberay.upgrade_strategy(rayservice) == "NewCluster":
                took = self.roll(rayservice, document, on_switch)
                return [*done, f"rolled to a new cluster {self.cluster_name}: {took}"]
            done.append("cluster spec left unapplied (upgradeStrategy None)")
        if document != self.serve_config_taken:
            self.operator.submit(document)
            self.serve_config_taken = self.serve_config_now = document
            done.append("serveConfigV2 submitted in place")
        return done

    def roll(self, rayservice: dict[str, Any], document: dict[str, Any], on_switch=None):
        """KubeRay's NewCluster upgrade: a pending RayCluster of the new spec (a new name, so new
        pod names and addresses, and a GCS namespace of its own) started beside the serving
        one, and the Serve config submitted to it; once every application runs there and its
        proxies' pods are Ready, the API Service's endpoints are its pods (`on_switch` gets
        them: kube-proxy's part). Then the old cluster's pods are deleted at once, each as
        kubelet deletes a pod (preStop, SIGTERM, grace period). KubeRay first waits
        rayClusterDeletionDelaySeconds (the profile's 630 s); here only the pods' preStop drain
        lets their requests finish, which asks more of the chart. Returns seconds to each step."""
        started, old = time.monotonic(), list(self.pods.values())
        cluster = kuberay.new_cluster_name(rayservice)
        self.storages[cluster], self.tokens[cluster] = str(uuid.uuid4()), kuberay.new_token()
        plans = kuberay.pod_plans(rayservice, cluster)
        fresh = []
        for plan in plans:
            endpoint = self.network.add(plan.name, kuberay.NAMESPACE, plan.labels)
            fresh.append(self._pod(plan, endpoint))
            self.pods[plan.name] = fresh[-1]
        head, *workers = fresh
        self.dns.set(kuberay.head_service_host(cluster), head.endpoint.ip)
        self.enforce_policy()
        self._start(head)
        self.wait_until(lambda: head.prober.ready, f"{head.plan.name} Ready")
        for pod in workers:
            self._start(pod)
        for pod in workers:
            self.wait_until(lambda p=pod: p.prober.started, f"{pod.plan.name} started")
        took = {"pods_started_s": time.monotonic() - started}
        token = self.tokens[cluster] if self.auth else None
        operator = kuberay.Operator(self.clients["operator"], head.endpoint.ip, token)
        operator.submit(document)
        operator.wait_running(self.app_names(), timeout_s=DEPLOY_TIMEOUT_S)
        took["serving_s"] = time.monotonic() - started
        # The switch: the RayService's active cluster, and the Service's selector with it.
        self.cluster_name, self.operator, self.head_ip = cluster, operator, head.endpoint.ip
        self.templates = {p.group: p for p in plans}
        self.cluster_spec = kuberay.cluster_spec_hash(rayservice)
        self.serve_config_taken = self.serve_config_now = document
        proxies = operator.proxy_ips()
        serving = self.wait_serving(max(1, len([p for p in workers if p.endpoint.ip in proxies])))
        if on_switch is not None:
            on_switch(serving)
        took["switched_s"] = time.monotonic() - started
        self.terminating.update(p.plan.name for p in old)
        with ThreadPoolExecutor(len(old)) as deleting:
            list(deleting.map(lambda pod: pod.delete(), old))
        for pod in old:
            del self.pods[pod.plan.name]
            self.network.remove(pod.plan.name)
            self.rulesets.pop(pod.plan.name, None)
        self.enforce_policy()
        took["old_deleted_s"] = time.monotonic() - started
        return {k: round(v, 1) for k, v in took.items()}

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
    def token(self) -> str | None:
        """The Ray token of the cluster that serves, as the operator sends it."""
        return self.tokens[self.cluster_name] if self.auth else None

    @property
    def head(self) -> Pod:
        return next(p for p in self.pods.values() if p.plan.head)

    def exits(self) -> dict[str, int]:
        """Containers that exited and were started again (kubectl's RESTARTS), by pod."""
        return {n: len(p.prober.exits) for n, p in self.pods.items() if p.prober and p.prober.exits}

    def workers(self) -> list[Pod]:
        return [p for p in self.pods.values() if not p.plan.head]

    def app_names(self) -> set[str]:
        return {app["name"] for app in self.rendered.serve_config["applications"]}

    # -- clients ---------------------------------------------------------------------------

    def api_url(self, pod: Pod) -> str:
        return f"http://{pod.endpoint.ip}:{kuberay.SERVE_PORT}/v1"

    def serving_pods(self) -> list[Pod]:
        """The API Service's endpoints: pods of the RayService's active cluster, not being
        deleted, whose readiness probe passes (a worker's checks its Serve proxy, which runs only
        on nodes with replicas). The head
        only when the RayService does not exclude it; KubeRay then decides by its own check of
        the head's proxy."""
        serving = []
        for name, pod in self.pods.items():
            if name in self.terminating or pod.prober is None or not pod.prober.ready:
                continue
            if pod.plan.labels["ray.io/cluster"] != self.cluster_name:
                continue  # a pending cluster's, before the switch
            if pod.plan.head:
                if self.exclude_head:
                    continue
                proxy = f"http://localhost:{pod.plan.serve_port}/-/healthz"
                if pod.exec(["wget", "-T", "10", "-q", "-O-", proxy]).returncode != 0:
                    continue
            serving.append(pod)
        return serving

    def wait_serving(self, count: int, timeout_s: float = 60) -> list[Pod]:
        """At least `count` endpoints of the API Service (a worker whose probe missed once is
        out of them for a probe period, as on a cluster)."""

        def enough() -> list[Pod]:
            pods = self.serving_pods()
            return pods if len(pods) >= count else []

        return self.wait_until(enough, f"{count} pods serving", timeout_s)

    def restarts(self) -> dict[str, list[str]]:
        """Containers kubelet would have restarted for their probes: liveness or startup
        failures past their thresholds."""
        return {
            n: p.prober.restarts for n, p in self.pods.items() if p.prober and p.prober.restarts
        }

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
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)
        if self.release is not None:
            self.release.close()
        self.network.close()

    def describe(self) -> str:
        """What a failing test shows: each pod's log tail."""
        return "\n".join(
            f"--- {n}\n{p.log.read_text()[-1500:] if p.log.exists() else ''}"
            for n, p in self.pods.items()
        )
