"""What a review of the chart found, one check each: the GB200 model cache (a storage class that
provides ReadWriteMany, writable by uid 1000, mounted only where engines run), the KubeRay version
the RayService's fields need, upgrade strategies that work on a fixed pool of trays, engines kept
off the head, tensor parallel groups kept inside one tray, the kustomize path (image, monitors,
the Hugging Face token), shared memory that holds Ray's object store, probe timeouts, name
lengths KubeRay accepts, and draining a Ray pod before it stops."""

from __future__ import annotations

import copy
import re
import shutil
from typing import Any

import pytest
import yaml

from specserve.config.serve_config import ROUTER_APP_NAME, ROUTER_DEPLOYMENT_NAME, serve_config
from tests.deploy.conftest import (
    ROOT,
    generate,
    one,
    pod_specs,
    render_objects,
    render_upgrade,
    validate_all,
)
from tests.deploy.test_k8s import kustomize

PROFILES = ("cpu", "gb200")
GB200_FILE = generate.CHART / "values-gb200.yaml"
NOTES = "specserve/templates/NOTES.txt"
# Ray Serve LLM's engine replica on the CPU profile: one bundle of 2 CPUs (replica + engine).
ENGINE_BUNDLE_CPUS = 2
UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6}
UNITS |= {"G": 10**9, "T": 10**12}


def chart_values(profile: str) -> dict[str, Any]:
    values = yaml.safe_load((generate.CHART / "values.yaml").read_text())
    return generate._merge(values, generate.profile_values(profile))


def refused(values: dict[str, Any], **kwargs: Any) -> str:
    """The error Helm gives for values the chart must refuse."""
    import helm_python as helm

    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as info:
        generate.render(values, **kwargs)
    return str(info.value)


def groups(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def to_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"([0-9]+)([A-Za-z]*)", str(quantity)).groups()  # type: ignore[union-attr]
    return int(number) * UNITS[unit]


# 1. The GB200 model cache


def test_a_read_write_many_cache_without_a_storage_class_is_refused_naming_the_key():
    """The usual default classes (block storage) provide no ReadWriteMany: the claim would stay
    Pending. values-gb200.yaml alone names no class, so the install says which key to set."""
    gb200 = yaml.safe_load(GB200_FILE.read_text())
    gb200["config"] = generate.pinned(gb200["config"], generate.PLACEHOLDER_COMMIT)
    assert "modelCache.storageClassName" in refused(gb200)
    # An existing claim is the operator's: no class needed.
    objs = render_objects("gb200", modelCache={"storageClassName": "", "existingClaim": "weights"})
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for pod in pod_specs(objs)
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"weights"}


def test_the_model_cache_is_mounted_where_engines_run_only_and_checked_writable():
    objs = render_objects("gb200")
    head, *workers = pod_specs(objs)
    assert "model-cache" not in {v["name"] for v in head["volumes"]}
    assert "HF_HOME" not in {e["name"] for e in head["containers"][0]["env"]}
    assert not head.get("initContainers")
    for pod in workers:
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"].startswith(chart_values("gb200")["modelCache"]["mountPath"] + "/")
        # fsGroup does not apply on NFS-style volumes: a check as the pod's own user, without
        # privilege, stops the pod with a message instead of a download failing deep in vLLM.
        (check,) = pod["initContainers"]
        assert check["securityContext"] == container["securityContext"]
        assert "model-cache" in {m["name"] for m in check["volumeMounts"]}
        assert "HF_HOME" in " ".join(check["command"])
        assert {e["name"]: e.get("value") for e in check["env"]}["HF_HOME"] == env["HF_HOME"]
    validate_all(objs)


def test_a_read_write_once_cache_mounted_by_several_pods_is_refused():
    """ReadWriteOnce attaches to one node: a second pod elsewhere waits on a Multi-Attach
    error. The CPU profile's four engine pods cannot share it; one engine pod can."""
    values = generate._merge(generate.profile_values("cpu"), {"modelCache": {"enabled": True}})
    assert "modelCache.accessModes" in refused(values)
    workers = chart_values("cpu")["workerGroups"]
    one_pod = [{**workers[0], "replicas": 1, "minReplicas": 1, "maxReplicas": 1}]
    objs = render_objects("cpu", modelCache={"enabled": True}, workerGroups=one_pod)
    assert one(objs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]


# 2. The KubeRay version


def test_kuberay_older_than_the_charts_minimum_is_refused_and_the_minimum_is_stated():
    chart = yaml.safe_load((generate.CHART / "Chart.yaml").read_text())
    minimum = chart["annotations"]["specserve.io/kuberay-min-version"]
    major, minor, patch = (int(p) for p in minimum.split("."))
    # authOptions needs 1.5.1, the serve Service's own port 1.6.
    assert (major, minor, patch) >= (1, 6, 0)
    older = f"{major}.{minor - 1}.0"
    message = refused(
        generate._merge(generate.profile_values("cpu"), {"kuberay": {"version": older}})
    )
    assert "kuberay.version" in message and minimum in message
    objs = render_objects("cpu", kuberay={"version": minimum})
    assert one(objs, "RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    for text in (ROOT / "README.md", ROOT / "docs" / "kubernetes.md"):
        assert f"KubeRay {minimum}" in text.read_text(), text
    notes = generate.render(
        generate._merge(generate.profile_values("cpu"), {"service": {"port": 9000}})
    )
    assert f"KubeRay {minimum}" in notes[NOTES]
    # The serve Service listens on service.port (KubeRay 1.6+ keeps it).
    assert "port-forward svc/specserve-api 8000:9000" in notes[NOTES]


# 3. Upgrade strategy


def test_gb200_upgrades_in_place_and_the_incremental_strategy_is_not_offered():
    """A second full cluster needs twice the trays: on a fixed pool it stays Pending."""
    spec = one(render_objects("gb200"), "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}
    values = generate._merge(
        generate.profile_values("cpu"),
        {"ray": {"upgradeStrategy": "NewClusterWithIncrementalUpgrade"}},
    )
    assert "/ray/upgradeStrategy" in refused(values)
    assert "upgradeStrategy: None" in (ROOT / "docs" / "kubernetes.md").read_text()


def test_under_upgrade_strategy_none_a_change_of_the_running_clusters_spec_is_refused(tmp_path):
    """KubeRay applies a new Serve config to the running cluster and leaves a changed cluster
    spec unapplied under None: new code in old pods. The chart refuses such an upgrade, and
    lets through what KubeRay applies in place (the Serve config, worker replica counts)."""
    import helm_python as helm

    installed = generate.profile_values("gb200")
    running = one(generate.objects(generate.render(installed)), "RayService")
    image = generate._merge(installed, {"image": {"tag": "0.2.0-gpu"}})
    with pytest.raises(helm.HelmRenderError, match="ray.upgradeStrategy None: this upgrade"):
        render_upgrade(image, running, tmp_path / "image")
    params = generate._merge(installed, {"head": {"rayStartParams": {"num-cpus": "1"}}})
    with pytest.raises(helm.HelmRenderError, match="delete the RayService first"):
        render_upgrade(params, running, tmp_path / "params")
    # Arms, weights, limits (the Serve config and the router's ConfigMap) and worker counts.
    config = installed["config"]
    arms = [{**arm, "weight": 50 if arm["name"] == "no-spec" else 25} for arm in config["arms"]]
    arms[-1]["speculative"] = {**arms[-1]["speculative"], "num_speculative_tokens": 4}
    serving = {
        "config": {**config, "arms": arms, "limits": {"max_tokens": 1024}},
        "workerGroups": [{**installed["workerGroups"][0], "replicas": 4, "maxReplicas": 4}],
    }
    served = generate.objects(
        render_upgrade(generate._merge(installed, serving), running, tmp_path / "ok")
    )
    assert one(served, "RayService")["spec"]["serveConfigV2"] != running["spec"]["serveConfigV2"]
    # Under NewCluster KubeRay rolls the cluster: nothing to refuse.
    rolled = generate._merge(image, {"ray": {"upgradeStrategy": "NewCluster"}})
    assert one(generate.objects(render_upgrade(rolled, running, tmp_path / "new")), "RayService")


def router_configmap(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap"
        and o["metadata"]["labels"].get("app.kubernetes.io/component") == "router-config"
    ]
    return found


def test_an_upgrade_renders_back_what_config_apply_wrote_unless_the_values_config_changed(
    tmp_path,
):
    """After `specserve config apply` (a weight and an arm's k changed), `helm upgrade` with the
    same values' config renders the live ConfigMap's text and the live serveConfigV2 byte for
    byte: neither reverted, nor in conflict with the fields `config apply` owns. Values whose
    config changed are rendered (the operator forces them); so are those of an older chart's
    ConfigMap, which carries no values revision."""
    from specserve.config.schema import parse_config, revision_of
    from specserve.config.serve_config import dump_serve_config, merge_arm_applications

    installed = chart_values("cpu")
    objs = generate.objects(generate.render(installed))
    configmap, running = router_configmap(objs), one(objs, "RayService")
    # What `config apply` writes (config/cluster_store.py): the file, its revision, the arms.
    applied = configmap["data"]["config.yaml"].replace("weight: 25", "weight: 40", 1)
    applied = applied.replace("num_speculative_tokens: 1", "num_speculative_tokens: 2", 1)
    assert applied.count("weight: 40") == 1 and "num_speculative_tokens: 2" in applied
    live = copy.deepcopy(configmap)
    live["data"]["config.yaml"] = applied
    live["metadata"]["annotations"]["specserve.io/revision"] = revision_of(applied.encode())
    document = yaml.safe_load(running["spec"]["serveConfigV2"])
    merged = dump_serve_config(merge_arm_applications(document, parse_config(applied)))
    assert merged != running["spec"]["serveConfigV2"]  # an arm changed: its application too
    running = copy.deepcopy(running)
    running["spec"]["serveConfigV2"] = merged

    # The same values, another setting changed: what config apply wrote stays, to the byte.
    upgraded = generate._merge(installed, {"router": {"configPollSeconds": 2}})
    objs = generate.objects(render_upgrade(upgraded, running, tmp_path / "same", live))
    kept = router_configmap(objs)
    assert kept["data"]["config.yaml"] == applied
    assert kept["metadata"]["annotations"]["specserve.io/revision"] == revision_of(applied.encode())
    served = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    arms = {app["name"]: app for app in served["applications"]}
    assert arms["arm-eagle3"]["args"]["arm"]["speculative"]["num_speculative_tokens"] == 2
    unchanged = generate.objects(render_upgrade(installed, running, tmp_path / "none", live))
    assert one(unchanged, "RayService")["spec"]["serveConfigV2"] == merged  # shared, not fought

    # The values' config changed: the operator's (helm upgrade --force-conflicts) wins.
    config = installed["config"]
    reweighted = {**config, "arms": [{**arm, "weight": 10} for arm in config["arms"]]}
    changed = generate._merge(installed, {"config": reweighted})
    objs = generate.objects(render_upgrade(changed, running, tmp_path / "changed", live))
    text = router_configmap(objs)["data"]["config.yaml"]
    assert text != applied and [a["weight"] for a in yaml.safe_load(text)["arms"]] == [10] * 4
    # A ConfigMap an older chart rendered (no values revision): the values', as before.
    del live["metadata"]["annotations"]["specserve.io/values-revision"]
    objs = generate.objects(render_upgrade(installed, running, tmp_path / "older", live))
    assert router_configmap(objs)["data"] == configmap["data"]


# 4. Engines off the head


@pytest.mark.parametrize("profile", PROFILES)
def test_no_engine_fits_on_the_head_and_the_router_needs_no_cpu(profile):
    objs = render_objects(profile)
    head, *workers = groups(objs)
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    document = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    (router,) = [app for app in document["applications"] if app["name"] == ROUTER_APP_NAME]
    (deployment,) = router["deployments"]
    assert deployment["name"] == ROUTER_DEPLOYMENT_NAME
    assert deployment["ray_actor_options"] == {"num_cpus": 0}
    if profile == "cpu":
        arms = chart_values(profile)["config"]["arms"]
        cpus = sum(int(g["rayStartParams"]["num-cpus"]) * g["replicas"] for g in workers)
        assert cpus >= ENGINE_BUNDLE_CPUS * sum(a.get("replicas", 1) for a in arms)


def test_draining_the_router_keeps_its_resources():
    """A changed ray_actor_options restarts replicas: draining must change user_config only."""
    from specserve.config.schema import parse_config
    from specserve.config.serve_config import draining_router

    config = parse_config(yaml.safe_dump(chart_values("cpu")["config"]))
    router = serve_config(config)["applications"][0]
    (deployment,) = draining_router(router)["deployments"]
    assert deployment["ray_actor_options"] == {"num_cpus": 0}
    assert deployment["user_config"] == {"draining": True}


def test_gb200_installs_only_with_the_commits_of_the_repositories_whose_code_runs():
    """The GB200 arms set trust_remote_code, so the engines run the code in the model's and the
    drafters' hub repositories: the install names the commits (values-gb200.yaml cannot know
    which ones the operator reviewed), as `--set` says, and the engines load those."""
    gb200 = generate._merge(yaml.safe_load(GB200_FILE.read_text()), generate.SITE_VALUES["gb200"])
    assert "--set config.model.revision=COMMIT" in refused(gb200)
    commit = "0123456789abcdef0123456789abcdef01234567"
    gb200["config"]["model"]["revision"] = commit
    # The first arm with a drafter from the hub (eagle3, index 1) is named with its index.
    message = refused(gb200)
    assert "--set config.arms[1].speculative.revision=COMMIT" in message
    assert "lightseekorg/kimi-k2.6-eagle3-mla" in message
    pinned = generate.pinned(gb200["config"], commit)
    objs = render_objects("gb200", config=pinned)
    serve = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    arms = {app["name"]: app["args"] for app in serve["applications"] if "arm" in app["args"]}
    assert {args["model"]["revision"] for args in arms.values()} == {commit}
    drafters = [
        args["arm"]["speculative"]
        for args in arms.values()
        if "model" in args["arm"]["speculative"]
    ]
    assert len(drafters) == 2 and {d["revision"] for d in drafters} == {commit}
    # Without code loading nothing needs pinning.
    plain = generate._merge(gb200, {})
    plain["config"] = {**gb200["config"], "model": {**gb200["config"]["model"]}}
    del plain["config"]["model"]["revision"]
    plain["config"]["arms"] = [
        {**arm, "engine": {**arm["engine"], "trust_remote_code": False}, "allow_code_loading": {}}
        for arm in gb200["config"]["arms"]
    ]
    assert generate.render(plain)


@pytest.mark.parametrize("profile", PROFILES)
def test_the_profiles_engine_settings_pass_vllms_parser(profile):
    # As installed: GB200's with the commits the install names (its revisions pass vLLM's
    # parser too).
    from specserve.config.checks import engine_problems
    from specserve.config.schema import RouterConfig

    config = RouterConfig.model_validate(chart_values(profile)["config"])
    assert engine_problems(config) == []


# 5. Tensor parallel inside one tray


@pytest.mark.parametrize("profile", PROFILES)
def test_every_engines_placement_group_stays_on_one_node(profile):
    from specserve.config.schema import ArmEngineConfig, ModelConfig
    from specserve.engine.arm import build_llm_config

    config = chart_values(profile)["config"]
    model = ModelConfig.model_validate(config["model"])
    for arm in config["arms"]:
        engine = ArmEngineConfig.model_validate({k: v for k, v in arm.items() if k != "weight"})
        built = build_llm_config(engine, model).get_engine_config()
        assert built.placement_strategy == "STRICT_PACK", arm["name"]
        size = arm["engine"].get("tensor_parallel_size", 1)
        device = "GPU" if config["model"]["accelerator"] == "gpu" else "CPU"
        assert [set(b) for b in built.placement_bundles] == [{device}] * size


# 6. The kustomize path


@pytest.mark.parametrize("profile", PROFILES)
def test_overlays_take_the_image_from_their_images_entry(profile, tmp_path):
    overlay = yaml.safe_load(
        (generate.K8S / "overlays" / profile / "kustomization.yaml").read_text()
    )
    repository = chart_values(profile)["image"]["repository"]
    (entry,) = overlay["images"]
    assert entry["name"] == repository and entry["newName"] == repository
    assert entry["newTag"].endswith("-gpu" if profile == "gb200" else "-cpu")
    # An overlay of the operator's own points it at their registry.
    shutil.copytree(generate.K8S, tmp_path / "k8s")
    mine = tmp_path / "mine"
    mine.mkdir()
    images = [{"name": repository, "newName": "registry.example/specserve", "newTag": "1.2.3"}]
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [f"../k8s/overlays/{profile}"], "images": images})
    )
    (service,) = [o for o in kustomize(mine) if o["kind"] == "RayService"]
    for group in groups([service]):
        for container in group["template"]["spec"]["containers"]:
            assert container["image"] == "registry.example/specserve:1.2.3"
    assert "kustomize edit set image" in (ROOT / "README.md").read_text()


def test_monitoring_component_carries_the_stack_release_label_and_no_namespace():
    directory = generate.K8S / "components" / "monitoring"
    for path in directory.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        obj = yaml.safe_load(path.read_text())
        assert obj["metadata"]["labels"]["release"], path.name
        assert "namespace" not in obj["metadata"], path.name
        assert "namespaceSelector" not in obj.get("spec", {}), path.name


def test_gb200_overlay_says_where_the_hugging_face_token_secret_comes_from():
    text = (generate.K8S / "overlays" / "gb200" / "kustomization.yaml").read_text()
    secret = chart_values("gb200")["huggingFaceToken"]["secretName"]
    assert f"create secret generic {secret}" in text
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    kustomize_part = docs[docs.index("## Without Helm") :]
    assert f"create secret generic {secret}" in kustomize_part


# 7. Shared memory, probes, names, monitors


@pytest.mark.parametrize("profile", PROFILES)
def test_every_groups_object_store_fits_in_its_shared_memory(profile):
    """Ray's default object store is 30% of the pod's memory, more than /dev/shm holds."""
    values = chart_values(profile)
    for group, settings in zip(
        groups(render_objects(profile)), [values["head"], *values["workerGroups"]], strict=True
    ):
        store = int(group["rayStartParams"]["object-store-memory"])
        assert 0 < store < to_bytes(settings["shmSizeLimit"])
    head = {**values["head"]["rayStartParams"], "object-store-memory": str(2 * 2**30)}
    overfull = generate._merge(generate.profile_values("cpu"), {"head": {"rayStartParams": head}})
    assert "head.rayStartParams.object-store-memory" in refused(overfull)


@pytest.mark.parametrize("profile", PROFILES)
def test_probes_wait_longer_than_their_commands_own_timeout(profile):
    for pod in pod_specs(render_objects(profile)):
        for container in pod["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if not probe or "exec" not in probe:
                    continue
                own = re.search(r"timeout=(\d+)", " ".join(probe["exec"]["command"]))
                assert own, (kind, probe)
                assert probe.get("timeoutSeconds", 1) > int(own.group(1)), (kind, probe)


def test_names_longer_than_kuberay_accepts_are_refused():
    """KubeRay appends 6 characters to a RayService's name for its RayCluster and refuses a
    RayService name over 47 characters."""
    values = generate.profile_values("cpu")
    message = refused(values, name="a" * 48)
    assert "47" in message and "fullnameOverride" in message
    objs = render_objects("cpu", fullnameOverride="s" * 47)
    assert len(one(objs, "RayService")["metadata"]["name"]) == 47
    for obj in objs:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    service = one(objs, "RayService")["spec"]["serveService"]["metadata"]["name"]
    assert len(service) <= 63


def test_notes_name_the_release_label_the_stacks_prometheus_selects():
    off = generate.render(generate.profile_values("cpu"))[NOTES]
    assert "monitoring.labels.release=" in off
    on = {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    unlabelled = generate._merge(generate.profile_values("cpu"), {"monitoring": on})
    assert "monitoring.labels.release" in generate.render(unlabelled)[NOTES]
    labelled = generate._merge(unlabelled, {"monitoring": {"labels": {"release": "kps"}}})
    assert "monitoring.labels.release" not in generate.render(labelled)[NOTES]


# 8. Draining a Ray pod before it stops


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("timeout_s", [None, 100])
def test_every_ray_pod_drains_before_kubelet_stops_it(profile, timeout_s):
    values = chart_values(profile)
    config = values["config"]
    if timeout_s is not None:
        config = {**config, "limits": {**config["limits"], "request_timeout_s": timeout_s}}
    objs = render_objects(profile, config=config)
    request_timeout_s = config["limits"]["request_timeout_s"]
    margin = values["drain"]["marginSeconds"]
    spec = one(objs, "RayService")["spec"]
    for pod in pod_specs(objs):
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= request_timeout_s + margin
        assert spec["rayClusterDeletionDelaySeconds"] >= grace
        for container in pod["containers"]:
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command[:3] == ["specserve", "drain-node", "--within-s"]
            within = int(command[3])
            assert request_timeout_s <= within < grace
            # The proxy of a node whose replicas left lives on for the dispatch's requests.
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert float(env["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"]) >= request_timeout_s
            # SIGTERM comes after the drain: Ray stops at once instead of draining again.
            assert float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) <= 0
    validate_all(objs)


def test_the_drain_has_a_budget_of_its_own_that_a_request_timeout_may_not_exceed():
    """request_timeout_s changes live (`config apply`) while the pod spec stays: the drain is
    sized by drain.requestSeconds, and a timeout above it is refused here (and by `config
    apply`, tests/deploy/test_config_rollout.py) instead of being cut at the next drain."""
    import helm_python as helm

    values = chart_values("cpu")

    def with_timeout(timeout_s: float) -> dict:
        config = values["config"]
        return {**config, "limits": {**config["limits"], "request_timeout_s": timeout_s}}

    def grace(objs) -> set[int]:
        return {pod["terminationGracePeriodSeconds"] for pod in pod_specs(objs)}

    budget = values["drain"]["requestSeconds"]
    # A lower timeout leaves the pods as they are: nothing in their spec follows the config.
    pods = [p for p in render_objects("cpu") if p["kind"] == "RayService"]
    lower = [p for p in render_objects("cpu", config=with_timeout(60)) if p["kind"] == "RayService"]
    assert pods[0]["spec"]["rayClusterConfig"] == lower[0]["spec"]["rayClusterConfig"]
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError), match="drain.requestSeconds"):
        render_objects("cpu", config=with_timeout(budget + 1))
    longer = render_objects(
        "cpu",
        config=with_timeout(budget + 300),
        drain={**values["drain"], "requestSeconds": budget + 300},
    )
    assert grace(longer) == {budget + 300 + values["drain"]["marginSeconds"]}
    (live,) = [o for o in longer if o["metadata"]["name"] == "specserve-config"]
    # Where `config apply` reads the budget.
    assert live["metadata"]["annotations"]["specserve.io/drain-request-seconds"] == str(
        budget + 300
    )


# More of the same kind


@pytest.mark.parametrize("profile", PROFILES)
def test_fs_group_is_applied_once_not_on_every_mount(profile):
    """kubelet walks every file of a volume that supports fsGroup on each mount unless told to
    stop at a root that already matches: a 600 GB cache would delay every pod start."""
    for pod in pod_specs(render_objects(profile)):
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_the_ingress_waits_as_long_as_a_request_may_run_and_streams_unbuffered():
    """ingress-nginx (the controller the network policy admits by default) cuts a response
    after 60 s without data and buffers it: a long stream or request would end early."""
    limits = {**chart_values("cpu")["config"]["limits"], "request_timeout_s": 900}
    config = {**chart_values("cpu")["config"], "limits": limits}
    ingress = {"enabled": True, "hosts": [{"host": "llm.example.com"}]}
    # As long as the longest request the release allows (the drain's budget, which the request
    # timeout may not exceed, and which does not change with a config apply).
    drain = {**chart_values("cpu")["drain"], "requestSeconds": 900}
    rendered = render_objects("cpu", config=config, ingress=ingress, drain=drain)
    annotations = one(rendered, "Ingress")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert int(annotations[prefix + "proxy-read-timeout"]) >= 900
    assert int(annotations[prefix + "proxy-send-timeout"]) >= 900
    assert annotations[prefix + "proxy-buffering"] == "off"
    # The operator's own annotations win.
    mine = {**ingress, "annotations": {prefix + "proxy-read-timeout": "3600"}}
    objs = render_objects("cpu", config=config, ingress=mine, drain=drain)
    assert one(objs, "Ingress")["metadata"]["annotations"][prefix + "proxy-read-timeout"] == "3600"
