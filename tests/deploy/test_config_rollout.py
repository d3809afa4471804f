"""`specserve config apply / history / rollback` against a Kubernetes API, end to end.

No Kubernetes API server can run on this machine, so these tests run the real CLI, with the
official `kubernetes` client, against `kube_standin.KubeStandin`: an in-process stand-in for
the API server that speaks its wire protocol for exactly the endpoints the commands use
(ConfigMaps: list by label, get, create, replace, merge patch, delete; RayServices: list, get,
merge patch), with its errors, resourceVersions and the rules of immutable ConfigMaps. The cluster
is seeded as the Helm chart creates it: the live config ConfigMap and the RayService whose
serveConfigV2 is `serve_config()` of that config, applied server-side by manager `helm` as Helm 4
installs them; the last test installs, upgrades and rolls back the chart's own render that way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client as kube_client
from kubernetes import config as kube_config

from specserve.cli import main
from specserve.config.cluster_store import FIELD_MANAGER
from specserve.config.schema import parse_config, revision_of
from specserve.config.serve_config import ROUTER_APP_NAME, serve_config
from tests.deploy.conftest import generate, release_objects, render_upgrade
from tests.deploy.kube_standin import CONFIGMAPS as configmaps
from tests.deploy.kube_standin import RAYSERVICES as rayservices
from tests.deploy.kube_standin import ApiError, KubeStandin

NAMESPACE = "serving"
RELEASE = "prod"
LIVE = "prod-specserve-config"
SERVICE = "prod-specserve"
DEFAULT = (Path(__file__).parents[2] / "service/specserve/configs/default.yaml").read_text()
WEIGHTS = DEFAULT.replace("- name: ngram\n    weight: 25", "- name: ngram\n    weight: 50")
DRAFTER = WEIGHTS.replace(
    'model: "package://eagle3"\n      num_speculative_tokens: 3',
    'model: "package://eagle3"\n      num_speculative_tokens: 4',
)
assert DRAFTER != WEIGHTS
INVALID = WEIGHTS.replace("weight: 50", "weight: fifty")
# What the commands may do, and all the Helm chart's Role grants them (`resource.group` for
# custom resources): no test may need more.
RBAC = {
    ("configmaps", "list"),
    ("configmaps", "create"),
    ("configmaps", "patch"),
    ("configmaps", "delete"),
    ("rayservices.ray.io", "list"),
    ("rayservices.ray.io", "patch"),
}


def labels(component: str | None = None, release: str = RELEASE) -> dict[str, str]:
    found = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/instance": release}
    return {**found, "app.kubernetes.io/component": component} if component else found


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in API server, empty, and a kubeconfig pointing at it."""
    standin = KubeStandin().start()
    kubeconfig = standin.write_kubeconfig(tmp_path / "kubeconfig", NAMESPACE)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    yield standin
    standin.stop()
    assert standin.verbs <= RBAC, f"requests beyond the chart's Role: {standin.verbs - RBAC}"
    patched = {
        path.split("?")[0].rsplit("/", 1)[1]
        for method, path, _ in standin.requests
        if method == "PATCH" and "/rayservices/" in path
    }
    assert patched <= {SERVICE}, f"the Role patches only this release's RayService: {patched}"
    patched = {  # by specserve (a test's own tampering has no field manager)
        path.split("?")[0].rsplit("/", 1)[1]
        for method, path, _ in standin.requests
        if method == "PATCH" and "/configmaps/" in path and f"fieldManager={FIELD_MANAGER}" in path
    }
    assert patched <= {LIVE}, f"the Role patches only this release's live ConfigMap: {patched}"


@pytest.fixture
def cluster(standin):
    """The stand-in with two releases' live ConfigMap and RayService, applied by `helm`."""
    for release, name in ((RELEASE, LIVE), ("staging", "staging-specserve-config")):
        standin.add(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": labels("router-config", release),
                    "annotations": {"specserve.io/revision": revision_of(DEFAULT.encode())},
                },
                "data": {"config.yaml": DEFAULT},
            }
        )
        # The chart's router settings differ from serve_config()'s defaults on purpose: they
        # come from Helm values and must survive every apply.
        document = serve_config(parse_config(DEFAULT), config_poll_s=2.0, router_replicas=2)
        standin.add(
            {
                "apiVersion": "ray.io/v1",
                "kind": "RayService",
                "metadata": {
                    "name": name.removesuffix("-config"),
                    "namespace": NAMESPACE,
                    "labels": labels(release=release),
                },
                "spec": {
                    "serveConfigV2": yaml.safe_dump(document, sort_keys=False),
                    "rayClusterConfig": {"rayVersion": "2.60.0"},
                },
            }
        )
    return standin


def specserve(*args: str) -> int:
    return main(["config", *args, "--release", RELEASE])


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def live_text(standin: KubeStandin) -> str:
    return standin.get("configmaps", NAMESPACE, LIVE)["data"]["config.yaml"]


def serve_document(standin: KubeStandin) -> dict:
    return yaml.safe_load(standin.get("rayservices", NAMESPACE, SERVICE)["spec"]["serveConfigV2"])


def apps(document: dict) -> dict[str, dict]:
    return {app["name"]: app for app in document["applications"]}


def history_revisions(standin: KubeStandin) -> set[str]:
    records = standin.list("configmaps", NAMESPACE, "app.kubernetes.io/component=config-history")
    return {r["metadata"]["labels"]["specserve.io/revision"] for r in records}


def test_apply_history_and_rollback_through_a_release_story(cluster, tmp_path, capsys):
    rev0, rev1, rev2 = (revision_of(t.encode()) for t in (DEFAULT, WEIGHTS, DRAFTER))
    service0 = cluster.get("rayservices", NAMESPACE, SERVICE)
    document0 = serve_document(cluster)
    staging0 = cluster.list("configmaps", NAMESPACE, "app.kubernetes.io/instance=staging")

    # A weight change: the live ConfigMap changes, the RayService is not written.
    assert specserve("apply", write(tmp_path, "weights.yaml", WEIGHTS)) == 0
    out = capsys.readouterr().out
    assert f"revision {rev0} -> {rev1}" in out
    assert "~ arm ngram weight 25 -> 50 (live)" in out
    assert "nothing redeploys" in out
    live = cluster.get("configmaps", NAMESPACE, LIVE)
    assert live["data"]["config.yaml"] == WEIGHTS
    assert live["metadata"]["annotations"]["specserve.io/revision"] == rev1
    assert live["metadata"]["labels"] == labels("router-config")
    assert cluster.get("rayservices", NAMESPACE, SERVICE) == service0
    assert not [w for w in cluster.writes() if "rayservices" in w[1]]
    # The chart's config got a record too, so it can be restored.
    assert history_revisions(cluster) == {rev0, rev1}
    record = cluster.get("configmaps", NAMESPACE, f"{LIVE}-{rev0}")
    assert record["immutable"] is True
    assert record["data"]["config.yaml"] == DEFAULT
    assert record["metadata"]["labels"] == {
        **labels("config-history"),
        "specserve.io/revision": rev0,
    }
    # The routers read the file byte for byte: its revision is the hash of these bytes.
    assert revision_of(live_text(cluster).encode()) == rev1

    # A drafter change: the arm's application changes, the router's does not.
    assert specserve("apply", write(tmp_path, "drafter.yaml", DRAFTER)) == 0
    out = capsys.readouterr().out
    assert f"revision {rev1} -> {rev2}" in out
    assert "~ arm eagle3 speculative changed (redeploys this arm)" in out
    assert "serveConfigV2 patched; Ray Serve redeploys arm-eagle3" in out
    service2 = cluster.get("rayservices", NAMESPACE, SERVICE)
    document2 = serve_document(cluster)
    router0, router2 = apps(document0)[ROUTER_APP_NAME], apps(document2)[ROUTER_APP_NAME]
    assert yaml.safe_dump(router2, sort_keys=False) == yaml.safe_dump(router0, sort_keys=False)
    assert {k: v for k, v in document2.items() if k != "applications"} == {
        k: v for k, v in document0.items() if k != "applications"
    }
    assert [a["name"] for a in document2["applications"]] == [
        a["name"] for a in document0["applications"]
    ]
    eagle3 = apps(document2)["arm-eagle3"]["args"]["arm"]["speculative"]
    assert eagle3["num_speculative_tokens"] == 4
    for other in ("arm-no-spec", "arm-ngram", "arm-eagle3.1"):
        assert apps(document2)[other] == apps(document0)[other]
    assert service2["spec"]["rayClusterConfig"] == service0["spec"]["rayClusterConfig"]
    assert int(service2["metadata"]["generation"]) == int(service0["metadata"]["generation"]) + 1

    # An invalid file: exit 2, not one request to the API server.
    requests = len(cluster.requests)
    assert specserve("apply", write(tmp_path, "invalid.yaml", INVALID)) == 2
    assert "arms.1.weight" in capsys.readouterr().err
    assert len(cluster.requests) == requests
    assert live_text(cluster) == DRAFTER

    # The history, newest first, the live one marked.
    assert specserve("history") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [rev2, rev1, rev0]
    assert lines[1].split()[2:4] == ["live", "no-spec=25"]
    assert "ngram=50" in lines[2] and "ngram=25" in lines[3]
    assert "live" not in lines[2].split()

    # Records are immutable on the server: their bytes cannot be rewritten.
    api = kube_config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
    core = kube_client.CoreV1Api(api)
    with pytest.raises(kube_client.ApiException) as refused:
        core.patch_namespaced_config_map(
            f"{LIVE}-{rev1}",
            NAMESPACE,
            {"data": {"config.yaml": "tampered"}},
            _content_type="application/merge-patch+json",
        )
    assert refused.value.status == 422

    # Rollback: the previous bytes, revision and arm applications return.
    applied_before = cluster.get("configmaps", NAMESPACE, f"{LIVE}-{rev1}")["metadata"][
        "annotations"
    ]["specserve.io/applied-at"]
    assert specserve("rollback") == 0
    out = capsys.readouterr().out
    assert (
        f"rolled back: ConfigMap {LIVE} (namespace {NAMESPACE}): revision {rev2} -> {rev1}" in out
    )
    assert "redeploys arm-eagle3" in out
    assert live_text(cluster) == WEIGHTS
    live = cluster.get("configmaps", NAMESPACE, LIVE)
    assert live["metadata"]["annotations"]["specserve.io/revision"] == rev1
    assert serve_document(cluster) == document0
    applied_after = cluster.get("configmaps", NAMESPACE, f"{LIVE}-{rev1}")["metadata"][
        "annotations"
    ]["specserve.io/applied-at"]
    assert applied_after > applied_before
    assert specserve("history") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [rev1, rev2, rev0]
    assert lines[1].split()[2] == "live"

    # --to with a prefix: the chart's original config, byte for byte.
    assert specserve("rollback", "--to", rev0[:5]) == 0
    assert f"revision {rev1} -> {rev0}" in capsys.readouterr().out
    assert live_text(cluster) == DEFAULT
    assert serve_document(cluster) == document0
    assert cluster.get("configmaps", NAMESPACE, LIVE)["metadata"]["annotations"] == {
        "specserve.io/revision": rev0
    }

    # Applying what is live changes nothing.
    writes = len(cluster.writes())
    assert specserve("apply", write(tmp_path, "default.yaml", DEFAULT)) == 0
    assert f"revision {rev0} is already live" in capsys.readouterr().out
    assert len(cluster.writes()) == writes

    # Another release in the same namespace was never touched.
    assert cluster.list("configmaps", NAMESPACE, "app.kubernetes.io/instance=staging") == staging0


def test_history_is_bounded_and_keeps_the_live_revision(cluster, tmp_path, capsys):
    texts = [DEFAULT.replace("weight: 25", f"weight: {w}", 1) for w in (1, 2, 3, 4, 5)]
    revisions = [revision_of(t.encode()) for t in texts]
    for i, text in enumerate(texts):
        assert specserve("apply", write(tmp_path, f"c{i}.yaml", text), "--keep", "3") == 0
    out = capsys.readouterr().out
    assert f"history: deleted {revision_of(DEFAULT.encode())}" in out
    assert history_revisions(cluster) == set(revisions[-3:])
    assert revision_of(live_text(cluster).encode()) == revisions[-1]
    # A pruned revision is gone: rolling back to it names the ones there are.
    assert specserve("rollback", "--to", revisions[0]) == 2
    err = capsys.readouterr().err
    assert f"no revision {revisions[0]!r}" in err
    assert ", ".join(reversed(revisions[-3:])) in err
    # Back to the oldest kept one, then one more apply with --keep 1: only the live one stays.
    assert specserve("rollback", "--to", revisions[-3]) == 0
    assert specserve("apply", write(tmp_path, "again.yaml", texts[-3]), "--keep", "1") == 0
    assert f"revision {revisions[-3]} is already live" in capsys.readouterr().out
    assert specserve("apply", write(tmp_path, "c4.yaml", texts[-1]), "--keep", "1") == 0
    assert history_revisions(cluster) == {revisions[-1]}
    assert ("configmaps", "delete") in cluster.verbs


def test_new_and_removed_arms_patch_the_rayservice(cluster, tmp_path, capsys):
    without_eagle31 = DEFAULT.split("  - name: eagle3.1")[0]
    text = without_eagle31 + (
        "  - name: ngram-k5\n"
        "    weight: 10\n"
        "    speculative: {method: ngram, num_speculative_tokens: 5}\n"
    )
    assert specserve("apply", write(tmp_path, "arms.yaml", text)) == 0
    out = capsys.readouterr().out
    assert "+ arm ngram-k5 weight 10 (new engine)" in out
    assert "- arm eagle3.1 (removed; its engine is deleted)" in out
    assert "Ray Serve redeploys arm-ngram-k5; deletes arm-eagle3.1" in out
    names = [app["name"] for app in serve_document(cluster)["applications"]]
    assert names == [ROUTER_APP_NAME, "arm-no-spec", "arm-ngram", "arm-eagle3", "arm-ngram-k5"]


def test_a_status_update_between_read_and_patch_is_retried(cluster, tmp_path, capsys):
    """KubeRay writes the RayService's status all the time; the arm patch carries the
    resourceVersion it read, gets a 409 Conflict, reads again and succeeds, keeping the status."""
    bumped = []

    def operator_writes_status(method: str, path: str) -> None:
        if method == "GET" and "rayservices" in path and not bumped:
            bumped.append(path)
            status = {"status": {"serviceStatus": "Running"}}
            cluster.patch(rayservices, NAMESPACE, SERVICE, status, "kuberay-operator")

    cluster.after_request = operator_writes_status
    assert specserve("apply", write(tmp_path, "drafter.yaml", DRAFTER)) == 0
    capsys.readouterr()
    patches = [w for w in cluster.writes() if w[0] == "PATCH" and "rayservices" in w[1]]
    assert len(patches) == 2
    service = cluster.get("rayservices", NAMESPACE, SERVICE)
    assert service["status"] == {"serviceStatus": "Running"}
    arm = apps(serve_document(cluster))["arm-eagle3"]["args"]["arm"]
    assert arm["speculative"]["num_speculative_tokens"] == 4


def test_an_interrupted_apply_is_completed_by_applying_again(cluster, tmp_path, capsys):
    """The RayService patch keeps losing (the ConfigMap is already written): exit 2; the same
    apply again is not a no-op but patches the arms it left behind."""

    def operator_always_first(method: str, path: str) -> None:
        if "rayservices" in path:
            touched = {"touched": str(len(cluster.requests))}
            patch = {"metadata": {"annotations": touched}}
            cluster.patch(rayservices, NAMESPACE, SERVICE, patch, "kuberay-operator")

    cluster.after_request = operator_always_first
    path = write(tmp_path, "drafter.yaml", DRAFTER)
    assert specserve("apply", path) == 2
    assert "the object has been modified" in capsys.readouterr().err
    assert live_text(cluster) == DRAFTER
    cluster.after_request = None
    assert specserve("apply", path) == 0
    rev2 = revision_of(DRAFTER.encode())
    assert f"revision {rev2} -> {rev2}" in capsys.readouterr().out
    assert (
        apps(serve_document(cluster))["arm-eagle3"]["args"]["arm"]["speculative"][
            "num_speculative_tokens"
        ]
        == 4
    )


def test_a_concurrent_change_of_the_live_config_fails_the_apply(cluster, tmp_path, capsys):
    def someone_else_applies(method: str, path: str) -> None:
        if method == "GET" and "router-config" in path:
            cluster.after_request = None
            patch = {"data": {"config.yaml": WEIGHTS}}
            cluster.patch(configmaps, NAMESPACE, LIVE, patch, "kubectl-edit")

    cluster.after_request = someone_else_applies
    assert specserve("apply", write(tmp_path, "drafter.yaml", DRAFTER)) == 2
    assert re.search(
        r"apply ConfigMap .*the object has been modified.*\(Conflict\)", capsys.readouterr().err
    )
    assert live_text(cluster) == WEIGHTS


def test_a_request_timeout_above_the_pods_drain_budget_is_refused(cluster, tmp_path, capsys):
    """The pods wait for requests as long as the chart's drain.requestSeconds (the annotation
    it writes on the live ConfigMap), whatever a config apply says: a longer request timeout
    would be cut at the next drain, so it is refused before anything is written."""
    budget = {"metadata": {"annotations": {"specserve.io/drain-request-seconds": "600"}}}
    cluster.patch(configmaps, NAMESPACE, LIVE, budget, "helm")
    longer = WEIGHTS.replace("request_timeout_s: 600", "request_timeout_s: 900")
    assert longer != WEIGHTS
    requests = len(cluster.requests)
    assert specserve("apply", write(tmp_path, "longer.yaml", longer)) == 2
    err = capsys.readouterr().err
    assert "request_timeout_s: 900 s" in err and "drain.requestSeconds" in err
    assert live_text(cluster) == DEFAULT and history_revisions(cluster) == set()
    assert all(method == "GET" for method, _, _ in cluster.requests[requests:])
    shorter = WEIGHTS.replace("request_timeout_s: 600", "request_timeout_s: 300")
    assert specserve("apply", write(tmp_path, "shorter.yaml", shorter)) == 0
    assert live_text(cluster) == shorter


def test_wrong_release_or_namespace_names_what_is_missing(cluster, tmp_path, capsys):
    path = write(tmp_path, "weights.yaml", WEIGHTS)
    assert main(["config", "apply", path, "--release", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no ConfigMap labelled" in err and "app.kubernetes.io/instance=nope" in err
    assert main(["config", "history", "--release", RELEASE, "-n", "default"]) == 2
    assert "in namespace default" in capsys.readouterr().err
    assert main(["config", "history", "--release", RELEASE, "--context", "elsewhere"]) == 2
    assert "no context 'elsewhere'" in capsys.readouterr().err
    assert live_text(cluster) == DEFAULT


def test_history_before_any_apply_says_the_live_config_is_unrecorded(cluster, capsys):
    assert specserve("history") == 0
    out = capsys.readouterr().out
    assert f"live revision {revision_of(DEFAULT.encode())}" in out and "no record yet" in out
    assert specserve("rollback") == 2
    assert "no history records yet" in capsys.readouterr().err
    assert cluster.writes() == []


# Helm 4 beside `config apply`: the chart rendered by the real Helm engine, applied as Helm does.

SPECSERVE_FIELDS = {".data.config.yaml", ".metadata.annotations.specserve.io/revision"}


def chart_objects(**values) -> list[dict]:
    """The release's live ConfigMap and RayService as the chart renders them with `values`."""
    merged = generate._merge(generate.profile_values("cpu"), values)
    rendered = generate.objects(generate.render(merged, name=RELEASE, namespace=NAMESPACE))
    found = release_objects(rendered, NAMESPACE)
    assert [o["metadata"]["name"] for o in found] == [LIVE, SERVICE]
    return found


def chart_upgrade_objects(standin: KubeStandin, tmp_path, **values) -> list[dict]:
    """As `chart_objects`, rendered as `helm upgrade` renders it: `lookup` finds the live
    ConfigMap and RayService in the stand-in."""
    merged = generate._merge(generate.profile_values("cpu"), values)
    rendered = render_upgrade(
        merged,
        standin.get("rayservices", NAMESPACE, SERVICE),
        tmp_path,
        standin.get("configmaps", NAMESPACE, LIVE),
        name=RELEASE,
        namespace=NAMESPACE,
    )
    return release_objects(generate.objects(rendered), NAMESPACE)


def helm(standin: KubeStandin, objects: list[dict], *, force_conflicts: bool = False) -> None:
    """`helm install | upgrade | rollback` of Helm 4: every rendered object applied server-side,
    whole, by field manager `helm`, with force only under `--force-conflicts`."""
    for obj in objects:
        standin.add(obj, manager="helm", force=force_conflicts)


def test_helm_upgrade_and_rollback_beside_config_apply(standin, tmp_path, capsys):
    """Install, `config apply`, `helm upgrade`, `helm rollback`, `config rollback`, `helm
    rollback` again, each leaving the expected live config and Serve config.

    What Helm 4 does (helm v4 source: pkg/cmd/upgrade.go, rollback.go, pkg/kube/client.go): it
    installs with server-side apply; `upgrade` and `rollback` keep the release's apply method
    (`--server-side=auto`) and apply every rendered object whole under field manager `helm`,
    with `force` only when `--force-conflicts` is given (default false). So after `config apply`
    a plain `helm upgrade` meets the fields `specserve` owns with other values and stops with a
    409 field conflict; `--force-conflicts` hands them back to Helm, as the runbook says."""
    config1 = yaml.safe_load(DEFAULT)
    install = chart_objects()
    helm(standin, install)
    chart_text = live_text(standin)
    chart_serve = serve_document(standin)
    router = apps(chart_serve)[ROUTER_APP_NAME]
    drafter = chart_text.replace("num_speculative_tokens: 1", "num_speculative_tokens: 3", 1)
    assert parse_config(drafter).arms[2].speculative.num_speculative_tokens == 3

    # config apply: a drafter change, so both the ConfigMap and serveConfigV2 change. Its
    # fields are then owned by `specserve` through an apply, every other field still by Helm.
    assert specserve("apply", write(tmp_path, "drafter.yaml", drafter)) == 0
    assert "Ray Serve redeploys arm-eagle3\n" in capsys.readouterr().out
    assert live_text(standin) == drafter
    assert apps(serve_document(standin))[ROUTER_APP_NAME] == router
    owners = standin.owners("configmaps", NAMESPACE, LIVE)
    assert owners[("specserve", "Apply")] == SPECSERVE_FIELDS
    assert not owners[("helm", "Apply")] & SPECSERVE_FIELDS
    assert ".metadata.labels.app.kubernetes.io/component" in owners[("helm", "Apply")]
    service_owners = standin.owners("rayservices", NAMESPACE, SERVICE)
    assert service_owners[("specserve", "Apply")] == {".spec.serveConfigV2"}
    assert {k for k in service_owners if k[0] == "specserve"} == {("specserve", "Apply")}

    # helm upgrade with the values' config as installed (the image moved on): the chart renders
    # the live config and Serve config back, so Helm shares the fields: no conflict, nothing
    # reverted, no arm redeployed.
    same = chart_upgrade_objects(standin, tmp_path / "same", image={"tag": "0.2.0-cpu"})
    helm(standin, same)
    assert live_text(standin) == drafter
    eagle3 = apps(serve_document(standin))["arm-eagle3"]["args"]["arm"]["speculative"]
    assert eagle3["num_speculative_tokens"] == 3
    assert standin.owners("configmaps", NAMESPACE, LIVE)[("specserve", "Apply")] == (
        SPECSERVE_FIELDS
    )
    # A router setting changed too: serveConfigV2 differs, so Helm must force it, and the arms
    # stay as `config apply` left them.
    polled = chart_upgrade_objects(standin, tmp_path / "polled", router={"configPollSeconds": 3.0})
    with pytest.raises(ApiError) as refused:
        helm(standin, polled)
    assert {c["field"] for c in refused.value.status()["details"]["causes"]} == {
        ".spec.serveConfigV2"
    }
    helm(standin, polled, force_conflicts=True)
    assert live_text(standin) == drafter
    eagle3 = apps(serve_document(standin))["arm-eagle3"]["args"]["arm"]["speculative"]
    assert eagle3["num_speculative_tokens"] == 3
    assert apps(serve_document(standin))[ROUTER_APP_NAME]["args"]["config_poll_s"] == 3.0

    # helm upgrade (a new weight and router setting in the values): refused, as Helm 4 refuses
    # it without --force-conflicts, naming the fields and their manager; nothing changes.
    config2 = {
        **config1,
        "arms": [{**a, "weight": 10 * (i + 1)} for i, a in enumerate(config1["arms"])],
    }
    upgrade = chart_objects(config=config2, router={"configPollSeconds": 3.0})
    with pytest.raises(ApiError) as refused:
        helm(standin, upgrade)
    status = refused.value.status()
    assert (status["code"], status["reason"]) == (409, "Conflict")
    assert {c["field"] for c in status["details"]["causes"]} == SPECSERVE_FIELDS
    assert {c["message"] for c in status["details"]["causes"]} == {'conflict with "specserve"'}
    assert status["message"].startswith("Apply failed with 2 conflicts: conflicts with")
    assert live_text(standin) == drafter
    # With --force-conflicts: the chart's new config and Serve config, all fields Helm's again.
    helm(standin, upgrade, force_conflicts=True)
    upgraded_text = live_text(standin)
    assert parse_config(upgraded_text).arms[1].weight == 20
    assert serve_document(standin) == yaml.safe_load(upgrade[1]["spec"]["serveConfigV2"])
    assert apps(serve_document(standin))[ROUTER_APP_NAME]["args"]["config_poll_s"] == 3.0
    for plural, name in (("configmaps", LIVE), ("rayservices", SERVICE)):
        assert {k[0] for k in standin.owners(plural, NAMESPACE, name)} == {"helm"}

    # helm rollback to the install: Helm owns every field, so no flag is needed.
    helm(standin, install)
    assert live_text(standin) == chart_text
    assert serve_document(standin) == chart_serve

    # config rollback: the revision applied before the live one (the chart's, recorded by the
    # first apply) is live, so the drafter change returns, arms included.
    assert specserve("rollback") == 0
    out = capsys.readouterr().out
    rev_chart, rev_drafter = revision_of(chart_text.encode()), revision_of(drafter.encode())
    assert f"revision {rev_chart} -> {rev_drafter}" in out
    assert live_text(standin) == drafter
    eagle3 = apps(serve_document(standin))["arm-eagle3"]["args"]["arm"]["speculative"]
    assert eagle3["num_speculative_tokens"] == 3
    assert apps(serve_document(standin))[ROUTER_APP_NAME] == router
    assert standin.owners("configmaps", NAMESPACE, LIVE)[("specserve", "Apply")] == (
        SPECSERVE_FIELDS
    )

    # The runbook's emergency rollback: `helm rollback --force-conflicts` to the install.
    with pytest.raises(ApiError):
        helm(standin, install)
    helm(standin, install, force_conflicts=True)
    assert live_text(standin) == chart_text
    assert serve_document(standin) == chart_serve
