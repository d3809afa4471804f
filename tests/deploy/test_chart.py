"""The Helm chart, rendered offline by the real Helm v4 engine for both profiles: valid objects,
the router config and Serve config it carries, the restricted Pod Security profile, refused bad
values, and values.schema.json in step with the router config's pydantic schema."""

from __future__ import annotations

import json

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from specserve.config import cluster_store
from specserve.config.schema import ArmEngineConfig, parse_config, revision_of
from specserve.config.serve_config import (
    ADMIN_KEYS_FILE,
    API_KEYS_FILE,
    MOUNTED_CONFIG_PATH,
    MOUNTED_KEYS_DIR,
    PROXY_HOOK,
    PROXY_HOOK_ENV,
    STICKY_SALT_FILE,
    WORKER_NICENESS,
    WORKER_NICENESS_ENV,
    serve_config,
)
from tests.deploy.conftest import (
    by_kind,
    generate,
    one,
    pod_specs,
    render_objects,
    validate_all,
)

PROFILES = ("cpu", "gb200")
# The key files of the mounted Secret, as the chart names them in the router's args.
KEY_FILES = {
    "api_keys_file": f"{MOUNTED_KEYS_DIR}/{API_KEYS_FILE}",
    "admin_keys_file": f"{MOUNTED_KEYS_DIR}/{ADMIN_KEYS_FILE}",
    "sticky_salt_file": f"{MOUNTED_KEYS_DIR}/{STICKY_SALT_FILE}",
}
MONITORING_ON = {
    "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
}


@pytest.fixture(scope="module", params=PROFILES)
def rendered(request):
    profile = request.param
    return profile, render_objects(profile, **MONITORING_ON)


def test_lint_is_clean_for_both_profiles():
    import helm_python as helm

    for profile in PROFILES:
        values = generate.profile_values(profile)
        report = helm.lint(str(generate.CHART), values=values, strict=True)
        # Severity 1 is informational ("icon is recommended"); 2 and up are warnings and errors.
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert report["total_charts_linted"] == 1 and not problems, (profile, problems)


def test_every_object_validates_against_kubernetes_and_crd_schemas(rendered):
    _, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {"RayService", "ConfigMap", "Service", "PodMonitor", "PrometheusRule", "Role"} <= kinds
    validate_all(objs)


def test_router_configmap_is_the_values_config_with_its_revision(rendered):
    profile, objs = rendered
    live = next(
        o
        for o in by_kind(objs, "ConfigMap")
        if o["metadata"]["labels"].get(cluster_store.COMPONENT_LABEL)
        == cluster_store.LIVE_COMPONENT
    )
    text = live["data"][cluster_store.CONFIG_KEY]
    config = parse_config(text)  # the routers accept it
    values_config = _merge_chart_values(profile)["config"]
    assert yaml.safe_load(text) == values_config
    # `config apply | rollback` find it and read its revision the way the routers compute it.
    labels = live["metadata"]["labels"]
    assert labels[cluster_store.NAME_LABEL] == cluster_store.APP_NAME
    assert labels[cluster_store.INSTANCE_LABEL] == generate.RELEASE
    annotations = live["metadata"]["annotations"]
    assert annotations[cluster_store.REVISION_KEY] == revision_of(text.encode())
    assert config.model.name == values_config["model"]["name"]


def test_serve_config_equals_what_specserve_renders_from_the_same_config(rendered):
    profile, objs = rendered
    service = one(objs, "RayService")
    document = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(document)
    values = _merge_chart_values(profile)
    expected = serve_config(
        parse_config(yaml.safe_dump(values["config"])),
        config_path=MOUNTED_CONFIG_PATH,
        config_poll_s=values["router"]["configPollSeconds"],
        router_replicas=values["router"]["replicas"],
        **KEY_FILES,
    )
    assert document == expected
    # Weights are not part of it: a weight change never redeploys an engine.
    assert '"weight"' not in json.dumps(document)


def test_an_arms_replica_and_queue_settings_render_as_its_deployment_options():
    """Outside the builder's args, so that Ray Serve applies a change to them in place."""
    document, expected = _serve_configs_with_arm(
        0, {"replicas": 2, "max_ongoing_requests": 8, "max_surge_percent": 100}
    )
    ServeDeploySchema.model_validate(document)
    assert document == expected
    first = document["applications"][1]
    assert first["deployments"] == [
        {
            "name": first["name"],
            "num_replicas": 2,
            "max_ongoing_requests": 8,
            "max_surge_percent": 100,
        }
    ]
    assert "replicas" not in first["args"]["arm"]
    # The other arms: only an EAGLE arm's drafter weights, null (its drafter's own).
    assert [app.get("deployments") for app in document["applications"][2:]] == [
        None,
        [{"name": "arm-eagle3", "user_config": {"drafter_weights": None}}],
        [{"name": "arm-eagle3.1", "user_config": {"drafter_weights": None}}],
    ]


def test_an_eagle_arms_drafter_weights_render_as_its_user_config_not_its_args():
    """Ray Serve hands `user_config` to the running replicas (ArmServer.reconfigure), which load
    the weights in place; in the args they would restart the engines."""
    document, expected = _serve_configs_with_arm(
        3, {"drafter_weights": "/drafters/eagle3.1-0123456789ab", "replicas": 2}
    )
    assert document == expected
    app = document["applications"][4]
    assert app["deployments"] == [
        {
            "name": "arm-eagle3.1",
            "num_replicas": 2,
            "user_config": {"drafter_weights": "/drafters/eagle3.1-0123456789ab"},
        }
    ]
    assert "drafter_weights" not in app["args"]["arm"]


def test_every_ray_container_loads_the_dispatch_into_its_http_proxy(rendered):
    """Requests are routed by the dispatch in each node's HTTP proxy: without it they reach the
    router application, which refuses them with 503."""
    _, objs = rendered
    for pod in pod_specs(objs):
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env[PROXY_HOOK_ENV] == PROXY_HOOK, container["name"]


def test_every_ray_container_runs_its_workers_at_normal_priority(rendered):
    """The engines and proxies are the pod's work, not below Ray's daemons (Ray's nice 15)."""
    _, objs = rendered
    for pod in pod_specs(objs):
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env[WORKER_NICENESS_ENV] == WORKER_NICENESS, container["name"]


def test_pods_pass_the_restricted_pod_security_profile(rendered):
    _, objs = rendered
    for pod in pod_specs(objs):
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
        assert context["seccompProfile"]["type"] == "RuntimeDefault"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert not any("hostPath" in v for v in volumes.values())
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert not sc.get("privileged")
            assert sc["runAsNonRoot"] is True
            assert sc["seccompProfile"]["type"] == "RuntimeDefault"
            assert sc["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            # Where Ray (sessions, logs) and vLLM (caches) write, on a read-only root.
            for path in ("/tmp", "/home/ray", "/dev/shm"):
                assert "emptyDir" in volumes[mounts[path]["name"]], path
            config_mount = mounts["/etc/specserve"]
            assert config_mount["readOnly"] is True
            assert volumes[config_mount["name"]]["configMap"]["name"].endswith("-config")
            env = {e["name"]: e for e in container["env"]}
            assert env["SPECSERVE_CONFIG"]["value"] == MOUNTED_CONFIG_PATH


def test_cpu_profile_is_the_embedded_default_without_gpus():
    objs = render_objects("cpu")
    config = _merge_chart_values("cpu")["config"]
    assert [arm["name"] for arm in config["arms"]] == ["no-spec", "ngram", "eagle3", "eagle3.1"]
    drafters = {arm["speculative"].get("model") for arm in config["arms"]}
    assert {"package://eagle3", "package://eagle3.1"} <= drafters
    assert config["model"]["source"] == "embedded://SmolLM2-135M-Instruct"
    for pod in pod_specs(objs):
        for container in pod["containers"]:
            assert container["image"].endswith("-cpu")
            assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    # Optional cluster features are off by default: no CRDs needed.
    assert not by_kind(objs, "PodMonitor") and not by_kind(objs, "PrometheusRule")


@pytest.mark.parametrize(("profile", "spare"), [("cpu", 1), ("gb200", 0)])
def test_the_workers_number_the_arm_replicas_and_the_profiles_spare(profile, spare):
    """One engine replica per worker pod (2 CPUs, or a 4-GPU tray): the CPU profile keeps one
    pod spare, for the replica of a drained or lost one; the GB200 profile none (a tray is
    expensive; docs/kubernetes.md, "Spare capacity")."""
    values = _merge_chart_values(profile)
    arm_replicas = sum(arm.get("replicas", 1) for arm in values["config"]["arms"])
    cluster = one(render_objects(profile), "RayService")["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"]
    assert workers["replicas"] == arm_replicas + spare


def test_gb200_profile_targets_4_gpu_arm64_trays_with_kimi_and_eagle_drafters():
    objs = render_objects("gb200")
    config = _merge_chart_values("gb200")["config"]
    arms = {arm["name"]: arm for arm in config["arms"]}
    assert list(arms) == ["no-spec", "eagle3", "eagle3.1"]
    assert config["model"]["source"] == "nvidia/Kimi-K2.6-NVFP4"
    assert config["model"]["accelerator"] == "gpu"
    assert arms["eagle3.1"]["speculative"]["model"] == "lightseekorg/kimi-k2.6-eagle3.1-mla"
    assert arms["eagle3"]["speculative"]["model"] == "lightseekorg/kimi-k2.6-eagle3-mla"
    for arm in arms.values():
        assert arm["engine"]["tensor_parallel_size"] == 4
        assert arm["engine"]["kv_cache_dtype"] == "fp8"
        assert arm["env"]["VLLM_USE_FLASHINFER_MOE_FP4"] == "1"
        # Kimi-K2.6's code ships with its checkpoint: the profile opts in to running it.
        assert arm["engine"]["trust_remote_code"] is True
        # And vLLM passes the flag on to the drafter: the EAGLE arms opt in to its code too.
        drafter = {"drafter": True} if "model" in arm["speculative"] else {}
        assert arm["allow_code_loading"] == {"engine": ["trust_remote_code"], **drafter}
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["rayStartParams"]["num-gpus"] == "4"
    pod = workers["template"]["spec"]
    assert pod["nodeSelector"] == {
        "kubernetes.io/arch": "arm64",
        "nvidia.com/gpu.product": "NVIDIA-GB200",
    }
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu", "kubernetes.io/arch"}
    (container,) = pod["containers"]
    assert container["image"].endswith("-gpu")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 3600
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes["model-cache"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_HOME"]["value"].startswith("/models")
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert head["num-gpus"] == "0"
    assert one(objs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_monitoring_objects_carry_the_stack_labels_and_the_rules_file():
    objs = render_objects(
        "cpu", monitoring={**MONITORING_ON["monitoring"], "labels": {"release": "kps"}}
    )
    monitor = one(objs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "specserve",
        "app.kubernetes.io/instance": generate.RELEASE,
    }
    # Every Ray pod exposes the port the monitor scrapes, and carries the labels it selects.
    for pod in pod_specs(objs):
        ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
        assert ports["metrics"] == 8080
    rule = one(objs, "PrometheusRule")
    rules_file = yaml.safe_load((generate.CHART / "rules/specserve-rules.yaml").read_text())
    assert rule["spec"] == rules_file


def test_dashboards_are_configmaps_for_grafanas_sidecar():
    objs = render_objects("cpu")
    dashboards = [
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard")
    ]
    files = sorted((generate.CHART / "dashboards").glob("*.json"))
    assert files and len(dashboards) == len(files)
    for configmap in dashboards:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads((generate.CHART / "dashboards" / name).read_text())
    off = render_objects("cpu", monitoring={"dashboards": {"enabled": False}})
    assert not [
        o for o in by_kind(off, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]
    ]


def test_dashboard_configmaps_have_names_of_their_own_for_every_release_name_length():
    values = generate._merge(
        generate.profile_values("cpu"), {"monitoring": {"dashboards": {"enabled": True}}}
    )
    for length in range(1, 38):  # a fullname "<release>-specserve" of at most 47
        objs = generate.objects(generate.render(values, name="r" * length))
        names = [
            o["metadata"]["name"]
            for o in by_kind(objs, "ConfigMap")
            if "grafana_dashboard" in o["metadata"]["labels"]
        ]
        assert len(names) == 2 and len(set(names)) == 2, (length, names)
        assert all(len(name) <= 63 for name in names)


def test_config_editor_role_grants_exactly_what_the_config_commands_use():
    role = one(render_objects("cpu"), "Role")
    granted = {
        (resource if not rule["apiGroups"][0] else f"{resource}.{rule['apiGroups'][0]}", verb)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    from tests.deploy.test_config_rollout import RBAC

    assert granted == RBAC
    objs = render_objects("cpu")
    patches = {rule["resources"][0]: rule for rule in role["rules"] if "patch" in rule["verbs"]}
    assert set(patches) == {"configmaps", "rayservices"}
    service = one(objs, "RayService")["metadata"]["name"]
    assert patches["rayservices"]["resourceNames"] == [service]  # no other release's RayService
    live = next(c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"].endswith("-config"))
    assert patches["configmaps"]["resourceNames"] == [live["metadata"]["name"]]  # nor ConfigMap


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bogus": 1}, "additional properties 'bogus' not allowed"),
        ({"config": {"arms": [{"name": "a", "weight": 1, "wieght": 2}]}}, "'wieght' not allowed"),
        ({"config": {"arms": [{"name": "a", "weight": -1}]}}, "/config/arms/0/weight"),
        ({"config": {"arms": []}}, "/config/arms"),
        ({"config": {"arms": [{"name": "a", "weight": 0}]}}, "at least one arm needs weight > 0"),
        (
            {"config": {"arms": [{"name": "a", "weight": 1}, {"name": "a", "weight": 1}]}},
            'duplicate arm name "a"',
        ),
        ({"config": {"arms": [{"name": "Bad_Name", "weight": 1}]}}, "/config/arms/0/name"),
        (
            {"config": {"arms": [{"name": "a", "weight": 1, "speculative": {"method": "medusa"}}]}},
            "/config/arms/0/speculative",
        ),
        (
            {
                "config": {
                    "arms": [{"name": "a", "weight": 1, "engine": {"trust_remote_code": True}}]
                }
            },
            "at '/config/arms/0': missing property 'allow_code_loading'",
        ),
        (
            {"config": {"arms": [{"name": "a", "weight": 1, "env": {"LD_PRELOAD": "/x.so"}}]}},
            "at '/config/arms/0': missing property 'allow_code_loading'",
        ),
        ({"router": {"replicas": 0}}, "/router/replicas"),
        ({"workerGroups": []}, "/workerGroups"),
        ({"apiKeys": {"enabled": False}}, "set apiKeys.allowUnauthenticated: true"),
        (
            {"ray": {"auth": "disabled"}, "networkPolicy": {"enabled": False}},
            "set ray.allowUnauthenticated: true",
        ),
        ({"apiKeys": {"enabled": True, "bogus": 1}}, "'bogus' not allowed"),
        ({"networkPolicy": {"enabled": True, "apiFrom": [{}]}}, "/networkPolicy/apiFrom/0"),
        (
            {
                "networkPolicy": {
                    "apiFrom": [{"namespaceSelector": {}}],
                    "operatorFrom": [{"namespaceSelector": {}}],
                }
            },
            "networkPolicy.apiFrom: peer",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(values, message):
    import helm_python as helm

    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as info:
        generate.render(values)
    assert message in str(info.value)


def test_ray_without_auth_renders_behind_the_network_policy_or_when_meant():
    assert generate.render({"ray": {"auth": "disabled"}})  # the NetworkPolicy stays on
    meant = {"ray": {"auth": "disabled", "allowUnauthenticated": True}}
    assert generate.render({**meant, "networkPolicy": {"enabled": False}})


def test_values_schema_config_part_is_generated_from_the_pydantic_schema():
    committed = json.loads(generate.SCHEMA.read_text())
    assert committed == generate.values_schema(), "run `make generate`"
    assert generate.GENERATED_TPL.read_text() == generate.generated_tpl(), "run `make generate`"


def test_an_arm_with_capture_deploys_as_specserve_renders_it():
    """`capture` is the router's: left in the engine application's args, ArmEngineConfig refuses
    it and the application never deploys."""
    document, expected = _serve_configs_with_arm(
        1, {"capture": {"sample": 0.05, "max_records": 1000}}
    )
    assert document == expected
    for app in document["applications"][1:]:
        ArmEngineConfig.model_validate(app["args"]["arm"])  # what the arm's builder takes


def _serve_configs_with_arm(index: int, settings: dict) -> tuple[dict, dict]:
    """The CPU profile's arm `index` given `settings`: the serveConfigV2 the chart renders, and
    what specserve renders from the same config."""
    values = _merge_chart_values("cpu")
    arms = values["config"]["arms"]
    arms[index] = {**arms[index], **settings}
    config = {**values["config"], "arms": arms}
    objs = render_objects("cpu", config=config)
    document = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    expected = serve_config(
        parse_config(yaml.safe_dump(config)),
        config_path=MOUNTED_CONFIG_PATH,
        config_poll_s=values["router"]["configPollSeconds"],
        router_replicas=values["router"]["replicas"],
        **KEY_FILES,
    )
    return document, expected


def _chart_values() -> dict:
    return yaml.safe_load((generate.CHART / "values.yaml").read_text())


def _merge_chart_values(profile: str) -> dict:
    return generate._merge(_chart_values(), generate.profile_values(profile))


def test_the_head_is_kept_from_drains_and_out_of_the_api_service():
    objs = render_objects("cpu")
    service = one(objs, "RayService")
    assert service["spec"]["excludeHeadPodFromServeSvc"] is True
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    workers = [
        g["template"]["metadata"]["labels"]
        for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    ]
    selector = pdb["spec"]["selector"]["matchLabels"].items()
    assert selector <= head.items()  # the head, and no worker
    assert not any(selector <= labels.items() for labels in workers)
    assert "gcsFaultToleranceOptions" not in service["spec"]["rayClusterConfig"]


def test_gcs_fault_tolerance_with_an_external_redis():
    ft = {"redisAddress": "redis.llm.svc:6379", "redisPasswordSecret": {"name": "r", "key": "p"}}
    objs = render_objects("cpu", ray={"version": "2.60.0", "gcsFaultTolerance": ft})
    validate_all(objs)
    options = one(objs, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "redis.llm.svc:6379"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "p"}
    # The new head's Serve controller gives busy replicas more than Ray's 30 s to answer before
    # it kills them as unrecoverable (an engine to load again).
    head = one(objs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    env = {e["name"]: e.get("value") for e in head["spec"]["containers"][0]["env"]}
    assert int(env["RAY_SERVE_SLOW_STARTUP_WARNING_S"]) >= 120


@pytest.mark.parametrize(
    ("address", "port"),
    [("redis.llm.svc:6380", 6380), ("rediss://redis.llm.svc:7000/0", 7000), ("redis", 6379)],
)
def test_the_network_policy_lets_the_head_reach_its_gcs_redis(address, port):
    def redis_rules(objs):
        policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
        ports = [(r, p) for r in policy["spec"]["egress"] for p in r.get("ports", [])]
        return [r for r, p in ports if p["port"] not in (53,)]

    assert not redis_rules(render_objects("cpu"))  # off: no way out but DNS and the release
    peers = [{"podSelector": {"matchLabels": {"app": "redis"}}}]
    ft = {"redisAddress": address, "redisTo": peers}
    objs = render_objects("cpu", ray={"version": "2.60.0", "gcsFaultTolerance": ft})
    validate_all(objs)
    (rule,) = redis_rules(objs)
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}] and rule["to"] == peers
