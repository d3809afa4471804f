"""`specserve drafter adapt` on Kubernetes (docs/drafters.md): the chart's optional RayJob, or a
RayCronJob on a schedule, valid against KubeRay v1.7's CRDs; its entrypoint is a command the
CLI parses; its pods read the capture store and the config, not the API keys, run restricted,
and carry the release's labels (so the NetworkPolicy lets them reach each other); GPU workers
ask for GPUs; configurations that cannot work are refused."""

from __future__ import annotations

import shlex

from specserve.cli import build_parser
from tests.deploy.conftest import by_kind, generate, one, render_objects, validate_all
from tests.deploy.test_chart_review import chart_values, refused

STORE = {"enabled": True, "accessModes": ["ReadWriteMany"], "storageClassName": "nfs"}
ADAPT = {"enabled": True, "arm": "eagle3.1", "extraArgs": ["--updates", "2000"]}


def job_pods(spec: dict) -> list[dict]:
    cluster = spec["rayClusterSpec"]
    return [g["template"]["spec"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def test_off_by_default():
    objs = render_objects("cpu", captureStore=STORE)
    assert not by_kind(objs, "RayJob") and not by_kind(objs, "RayCronJob")


def test_the_job_runs_adapt_on_the_capture_store_in_a_cluster_of_its_own():
    objs = render_objects("cpu", captureStore=STORE, adapt=ADAPT)
    validate_all(objs)
    job = one(objs, "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and "clusterSelector" not in spec
    mount = chart_values("cpu")["captureStore"]["mountPath"]
    command = shlex.split(spec["entrypoint"])
    assert command[:3] == ["specserve", "drafter", "adapt"]
    args = build_parser().parse_args(command[1:])  # the CLI takes it as written
    assert args.captured.as_posix() == mount and args.arm == "eagle3.1"
    assert args.work_dir.as_posix() == chart_values("cpu")["adapt"]["workStore"]["mountPath"]
    assert args.out.as_posix() == f"{mount}/_adapt/drafters"  # where the engines can load it
    assert args.address == "auto" and args.updates == 2000 and args.base == "package://eagle3.1"
    workers = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert [w["replicas"] for w in workers] == [args.workers] == [2]
    claim = one(objs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    engine_claim = next(
        v for v in claim["template"]["spec"]["volumes"] if v["name"] == "capture-store"
    )
    selector = one(objs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    for pod in [*job_pods(spec), spec["submitterPodTemplate"]["spec"]]:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert "api-keys" not in {v["name"] for v in pod["volumes"]}
    for group in [spec["rayClusterSpec"]["headGroupSpec"], *workers]:
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        pod = group["template"]["spec"]
        assert engine_claim in pod["volumes"]  # the engines' own claim
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["capture-store"] == mount and mounts["router-config"] == "/etc/specserve"
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["SPECSERVE_CONFIG"] == "/etc/specserve/config.yaml"
        assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" not in env  # it serves nothing


GATED = {"version": "1.7.0", "featureGates": ["RayCronJob"]}


def test_adapts_work_files_are_on_a_claim_no_engine_pod_mounts():
    """What adapt loads (shards, checkpoints) lives where only the job's pods can write: an
    engine pod, which mounts the capture store, cannot plant it."""
    objs = render_objects("cpu", captureStore=STORE, adapt=ADAPT)
    spec = one(objs, "RayJob")["spec"]
    work_dir = build_parser().parse_args(shlex.split(spec["entrypoint"])[1:]).work_dir
    claims = {c["metadata"]["name"]: c for c in by_kind(objs, "PersistentVolumeClaim")}
    work_claim = claims["specserve-adapt-work"]
    assert work_claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert work_claim["spec"]["storageClassName"] == "nfs"  # the capture store's by default
    assert "helm.sh/resource-policy" not in (work_claim["metadata"].get("annotations") or {})
    for pod in job_pods(spec):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["adapt-work"]["persistentVolumeClaim"]["claimName"] == "specserve-adapt-work"
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["adapt-work"] == work_dir.as_posix()
    store = chart_values("cpu")["captureStore"]["mountPath"]
    assert not work_dir.is_relative_to(store)
    service = one(objs, "RayService")["spec"]["rayClusterConfig"]
    for group in [service["headGroupSpec"], *service["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        claimed = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert "specserve-adapt-work" not in claimed
        assert all(
            m["mountPath"] != work_dir.as_posix() for m in pod["containers"][0]["volumeMounts"]
        )
    validate_all(objs)

    own = render_objects(
        "cpu", captureStore=STORE, adapt={**ADAPT, "workStore": {"existingClaim": "mine"}}
    )
    assert "specserve-adapt-work" not in {
        c["metadata"]["name"] for c in by_kind(own, "PersistentVolumeClaim")
    }
    for pod in job_pods(one(own, "RayJob")["spec"]):
        assert {"name": "adapt-work", "persistentVolumeClaim": {"claimName": "mine"}} in pod[
            "volumes"
        ]


def test_a_work_store_the_jobs_pods_cannot_share_or_that_is_the_capture_store_is_refused():
    def values(work_store: dict, store: dict = STORE) -> dict:
        return generate._merge(
            generate.profile_values("cpu"),
            {"captureStore": store, "adapt": {**ADAPT, "workStore": work_store}},
        )

    assert "adapt.workStore.accessModes" in refused(values({"accessModes": ["ReadWriteOnce"]}))
    mount = chart_values("cpu")["captureStore"]["mountPath"]
    for inside in (mount, f"{mount}/_adapt/work"):
        assert "adapt.workStore.mountPath" in refused(values({"mountPath": inside}))
    no_class = {**STORE, "storageClassName": "", "existingClaim": "captured"}
    assert "adapt.workStore.storageClassName" in refused(values({}, no_class))
    assert one(
        generate.objects(generate.render(values({"existingClaim": "w"}, no_class))), "RayJob"
    )


def test_a_schedule_makes_it_a_raycronjob_with_the_same_job():
    once = one(render_objects("cpu", captureStore=STORE, adapt=ADAPT), "RayJob")
    objs = render_objects(
        "cpu", captureStore=STORE, adapt={**ADAPT, "schedule": "0 3 * * 0"}, kuberay=GATED
    )
    validate_all(objs)
    cron = one(objs, "RayCronJob")
    assert not by_kind(objs, "RayJob")
    assert cron["spec"]["schedule"] == "0 3 * * 0"
    assert cron["spec"]["jobTemplate"] == once["spec"]


def test_gpu_workers_ask_for_their_gpus():
    objs = render_objects(
        "gb200", captureStore=STORE, adapt={**ADAPT, "gpusPerWorker": 1, "workers": 4}
    )
    validate_all(objs)
    spec = one(objs, "RayJob")["spec"]
    args = build_parser().parse_args(shlex.split(spec["entrypoint"])[1:])
    assert args.gpus_per_worker == 1 and args.workers == 4
    head, *workers = job_pods(spec)
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"].get("limits", {})
    assert len(workers) == 1
    assert workers[0]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_adapt_without_a_shared_capture_store_is_refused_naming_the_key():
    no_store = generate._merge(generate.profile_values("cpu"), {"adapt": {"enabled": True}})
    assert "captureStore" in refused(no_store)
    one_node = generate._merge(
        generate.profile_values("cpu"),
        {"adapt": {"enabled": True}, "captureStore": {"enabled": True, "existingClaim": "x"}},
    )
    assert "captureStore.accessModes" in refused(one_node)


LOOP = {
    **ADAPT,
    "loop": {"enabled": True, "prometheusUrl": "http://prometheus.monitoring:9090", "share": 0.2},
}


def test_the_loop_job_runs_specserve_loop_with_an_identity_that_may_change_the_config_only():
    objs = render_objects("cpu", captureStore=STORE, adapt=LOOP)
    validate_all(objs)
    spec = one(objs, "RayJob")["spec"]
    command = shlex.split(spec["entrypoint"])
    assert command[:2] == ["specserve", "loop"]
    args = build_parser().parse_args(command[1:])
    assert args.incumbent == "eagle3.1" and args.share == 0.2 and args.max_wait_s == 3600
    assert args.prometheus == "http://prometheus.monitoring:9090"
    assert args.release == "specserve" and args.namespace == "specserve"  # the rendered release
    assert args.base is None  # the incumbent arm's own drafter
    assert args.updates == 2000 and args.arm == "eagle3.1" and args.address == "auto"
    mount = chart_values("cpu")["captureStore"]["mountPath"]
    assert args.out.as_posix() == f"{mount}/_adapt/drafters"  # a path the engine pods mount

    # Only the head, where the driver runs, gets a token, of an account of its own...
    head, *workers = job_pods(spec)
    account = head["serviceAccountName"]
    assert head["automountServiceAccountToken"] is True and account.endswith("-loop")
    for pod in [*workers, spec["submitterPodTemplate"]["spec"]]:
        assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] != account
    # ...bound to the config editor's rules and nothing more.
    binding = next(b for b in by_kind(objs, "RoleBinding") if b["metadata"]["name"] == account)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "specserve"}
    ]
    role = next(r for r in by_kind(objs, "Role") if r["metadata"]["name"] == account)
    editor = render_objects("cpu", rbac={"configEditor": {"create": True}})
    editor_role = next(
        r for r in by_kind(editor, "Role") if "config-editor" in r["metadata"]["name"]
    )
    assert role["rules"] == editor_role["rules"]
    assert all(
        "*" not in rule["verbs"] and "secrets" not in rule["resources"] for rule in role["rules"]
    )

    # Its egress: Prometheus's namespace on its port and the API server's ports, the head only.
    policy = next(p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == account)
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        spec["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"].items()
    )
    for worker in spec["rayClusterSpec"]["workerGroupSpecs"]:
        labels = worker["template"]["metadata"]["labels"]
        assert not policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    to_prometheus, to_api = policy["spec"]["egress"]
    assert to_prometheus["ports"] == [{"port": 9090, "protocol": "TCP"}]
    namespace = to_prometheus["to"][0]["namespaceSelector"]["matchLabels"]
    assert namespace == {"kubernetes.io/metadata.name": "monitoring"}
    assert {p["port"] for p in to_api["ports"]} == {443, 6443} and "to" not in to_api


def test_the_loop_job_is_off_with_adapt_alone_and_needs_a_prometheus():
    objs = render_objects("cpu", captureStore=STORE, adapt=ADAPT)
    assert not [o for o in objs if o["metadata"]["name"].endswith("-loop")]
    no_url = generate._merge(
        generate.profile_values("cpu"),
        {"captureStore": STORE, "adapt": {**ADAPT, "loop": {"enabled": True}}},
    )
    assert "adapt.loop.prometheusUrl" in refused(no_url)


def test_a_schedule_needs_the_operators_raycronjob_feature_gate():
    """KubeRay 1.7 accepts a RayCronJob with the gate off and never runs it."""
    values = generate._merge(
        generate.profile_values("cpu"),
        {"captureStore": STORE, "adapt": {**ADAPT, "schedule": "0 3 * * 0"}},
    )
    assert "RayCronJob feature gate" in refused(values)


def test_adapt_job_names_past_kuberays_limits_are_refused():
    values = generate._merge(
        generate.profile_values("cpu"), {"captureStore": STORE, "adapt": ADAPT}
    )
    # "<release>-specserve-adapt": 47 characters pass as a RayJob, 48 do not.
    assert one(generate.objects(generate.render(values, name="r" * 31)), "RayJob")
    assert "at most 47" in refused(values, name="r" * 32)
    cron = generate._merge(values, {"adapt": {"schedule": "0 3 * * 0"}, "kuberay": GATED})
    assert one(generate.objects(generate.render(cron, name="r" * 20)), "RayCronJob")
    assert "at most 36" in refused(cron, name="r" * 21)
