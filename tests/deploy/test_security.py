"""The cluster's doors, as the chart renders them: the API keys Secret mounted in every Ray
container and named in the router's args, refused without keys unless asked for, the
deny-by-default NetworkPolicy checked peer by peer and port by port, and an Ingress and API
Service that carry the OpenAI API only."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest
import yaml

from specserve.config.serve_config import (
    ADMIN_KEYS_FILE,
    API_KEYS_FILE,
    HTTP_PORT,
    MOUNTED_KEYS_DIR,
    ROUTER_APP_NAME,
    STICKY_SALT_FILE,
)
from specserve.wire.auth import Identity, KeyRing
from tests.deploy.conftest import by_kind, generate, one, pod_specs, render_objects, validate_all

PROFILES = ("cpu", "gb200")
SELECTOR = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/instance": generate.RELEASE}
OWN_PODS = {"podSelector": {"matchLabels": SELECTOR}}
DASHBOARD_PORT, METRICS_PORT, GCS_PORT = 8265, 8080, 6379
KEYS_SECRET = f"{generate.RELEASE}-api-keys"
ISSUED_SECRET = f"{generate.RELEASE}-api-keys-issued"
PRIVATE_RANGES = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"}


def chart_values(profile: str) -> dict:
    values = yaml.safe_load((generate.CHART / "values.yaml").read_text())
    return generate._merge(values, generate.profile_values(profile))


def router_args(objs: list[dict]) -> dict:
    document = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    (router,) = [app for app in document["applications"] if app["name"] == ROUTER_APP_NAME]
    return router["args"]


def keys_mounts(objs: list[dict]) -> list[tuple[dict, dict]]:
    """(volume, mount) of the keys directory in every Ray container; fails where one lacks it."""
    found = []
    for pod in pod_specs(objs):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert MOUNTED_KEYS_DIR in mounts, container["name"]
            found.append((volumes[mounts[MOUNTED_KEYS_DIR]["name"]], mounts[MOUNTED_KEYS_DIR]))
    return found


def key_lines(secret: dict, key: str) -> list[str]:
    text = base64.b64decode(secret["data"][key]).decode()
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def ingress_peers(policy: dict, port: int) -> list[dict]:
    """Every peer the policy lets in on a TCP port (a rule without `ports` opens every port)."""
    peers = []
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        assert not any("endPort" in p for p in ports or []), "port ranges"
        if ports is None or any(
            p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports
        ):
            peers += rule["from"]
    return peers


@pytest.fixture(scope="module", params=PROFILES)
def rendered(request):
    return request.param, render_objects(request.param)


# API keys


def test_chart_creates_a_kept_secret_with_one_random_api_key_and_one_admin_key(rendered, tmp_path):
    """The mounted Secret holds the keys' digests only; the keys themselves are in a Secret of
    their own that no pod mounts, for the operator to hand out. The router takes the issued keys
    against the mounted files, and nothing else."""
    _, objs = rendered
    secrets = {s["metadata"]["name"]: s for s in by_kind(objs, "Secret")}
    assert set(secrets) == {KEYS_SECRET, ISSUED_SECRET}
    secret, issued = secrets[KEYS_SECRET], secrets[ISSUED_SECRET]
    for kept in (secret, issued):
        assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (api,) = key_lines(issued, API_KEYS_FILE)
    (admin,) = key_lines(issued, ADMIN_KEYS_FILE)
    assert re.fullmatch(r"default=[A-Za-z0-9]{40}", api), api
    assert re.fullmatch(r"admin=[A-Za-z0-9]{40}", admin), admin
    api_key, admin_key = api.split("=")[1], admin.split("=")[1]
    assert api_key != admin_key
    for file, line in ((API_KEYS_FILE, api), (ADMIN_KEYS_FILE, admin)):
        name, key = line.split("=")
        assert key_lines(secret, file) == [
            f"{name}=sha256:{hashlib.sha256(key.encode()).hexdigest()}"
        ]
        assert key not in base64.b64decode(secret["data"][file]).decode()
    for file in (API_KEYS_FILE, ADMIN_KEYS_FILE):
        (tmp_path / file).write_bytes(base64.b64decode(secret["data"][file]))
    ring = KeyRing(str(tmp_path / API_KEYS_FILE), str(tmp_path / ADMIN_KEYS_FILE))
    assert ring.identify(api_key) == Identity("default", admin=False)
    assert ring.identify(admin_key) == Identity("admin", admin=True)
    assert ring.identify(api.split("sha256:")[-1]) is None
    # The sticky hash's salt: a random secret of its own.
    salt = base64.b64decode(secret["data"][STICKY_SALT_FILE]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", salt) and salt not in (api, admin)
    # Drawn at render: another install gets other keys and another salt.
    again = {s["metadata"]["name"]: s for s in by_kind(render_objects(rendered[0]), "Secret")}
    assert key_lines(again[ISSUED_SECRET], API_KEYS_FILE) != [api]
    assert again[KEYS_SECRET]["data"][STICKY_SALT_FILE] != secret["data"][STICKY_SALT_FILE]
    validate_all([secret, issued])
    # The issued keys are mounted nowhere.
    for pod in pod_specs(objs):
        assert ISSUED_SECRET not in json.dumps(pod)


def test_every_ray_container_mounts_the_keys_secret_read_only(rendered):
    _, objs = rendered
    mounts = keys_mounts(objs)
    assert len(mounts) == 1 + len(chart_values(rendered[0])["workerGroups"])
    for volume, mount in mounts:
        assert volume["secret"]["secretName"] == KEYS_SECRET
        assert mount["readOnly"] is True
        # A subPath mount would never see a rotated key.
        assert "subPath" not in mount and "items" not in volume["secret"]


def test_router_args_name_the_mounted_key_files(rendered):
    _, objs = rendered
    args = router_args(objs)
    assert args["api_keys_file"] == f"{MOUNTED_KEYS_DIR}/{API_KEYS_FILE}"
    assert args["admin_keys_file"] == f"{MOUNTED_KEYS_DIR}/{ADMIN_KEYS_FILE}"
    assert args["sticky_salt_file"] == f"{MOUNTED_KEYS_DIR}/{STICKY_SALT_FILE}"


def test_an_existing_secret_is_mounted_and_none_is_created():
    objs = render_objects("cpu", apiKeys={"existingSecret": "my-keys"})
    assert not by_kind(objs, "Secret")
    for volume, _ in keys_mounts(objs):
        assert volume["secret"]["secretName"] == "my-keys"
    assert router_args(objs)["api_keys_file"] == f"{MOUNTED_KEYS_DIR}/{API_KEYS_FILE}"


def test_keys_off_is_refused_unless_unauthenticated_serving_is_asked_for():
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError, match="apiKeys.allowUnauthenticated"):
        render_objects("cpu", apiKeys={"enabled": False})
    objs = render_objects("cpu", apiKeys={"enabled": False, "allowUnauthenticated": True})
    assert not by_kind(objs, "Secret")
    args = router_args(objs)
    assert "api_keys_file" not in args and "admin_keys_file" not in args
    for pod in pod_specs(objs):
        for container in pod["containers"]:
            assert MOUNTED_KEYS_DIR not in {m["mountPath"] for m in container["volumeMounts"]}


def test_keys_are_on_by_default():
    values = chart_values("cpu")["apiKeys"]
    assert values["enabled"] is True and values["allowUnauthenticated"] is False


# Network policy


def test_network_policy_selects_every_ray_pod_and_denies_both_ways_by_default(rendered):
    _, objs = rendered
    policy = one(objs, "NetworkPolicy")
    validate_all([policy])
    assert policy["spec"]["podSelector"] == {"matchLabels": SELECTOR}
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert SELECTOR.items() <= labels.items()
    # No rule admits everyone: an empty or missing `from` / `to` would.
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])
    assert all(rule.get("to") for rule in policy["spec"]["egress"])


def test_serve_port_is_open_to_api_clients_the_operator_and_own_pods_only(rendered):
    profile, objs = rendered
    policy = one(objs, "NetworkPolicy")
    values = chart_values(profile)["networkPolicy"]
    assert values["apiFrom"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ]
    expected = [OWN_PODS, *values["apiFrom"], *values["operatorFrom"]]
    assert sorted(map(repr, ingress_peers(policy, HTTP_PORT))) == sorted(map(repr, expected))


def test_rays_dashboard_and_job_api_are_closed_to_api_clients(rendered):
    profile, objs = rendered
    policy = one(objs, "NetworkPolicy")
    values = chart_values(profile)["networkPolicy"]
    assert values["operatorFrom"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}
    ]
    dashboard = ingress_peers(policy, DASHBOARD_PORT)
    assert sorted(map(repr, dashboard)) == sorted(map(repr, [OWN_PODS, *values["operatorFrom"]]))
    assert not [peer for peer in values["apiFrom"] if peer in dashboard]
    # Ray's own ports: the release's pods only.
    assert ingress_peers(policy, GCS_PORT) == [OWN_PODS]


def test_metrics_port_is_open_to_prometheus_only(rendered):
    profile, objs = rendered
    policy = one(objs, "NetworkPolicy")
    values = chart_values(profile)["networkPolicy"]
    assert values["metricsFrom"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    peers = ingress_peers(policy, METRICS_PORT)
    assert sorted(map(repr, peers)) == sorted(map(repr, [OWN_PODS, *values["metricsFrom"]]))


def test_egress_is_dns_and_own_pods_plus_https_to_public_addresses_on_gb200(rendered):
    profile, objs = rendered
    egress = one(objs, "NetworkPolicy")["spec"]["egress"]
    dns, own, *extra = egress
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    assert dns["to"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    ]
    assert own == {"to": [OWN_PODS]}
    if profile == "cpu":
        assert extra == []  # the embedded model and drafters are in the image
        return
    (https,) = extra
    assert https["ports"] == [{"port": 443, "protocol": "TCP"}]
    blocks = [peer["ipBlock"] for peer in https["to"]]
    assert {block["cidr"] for block in blocks} == {"0.0.0.0/0", "::/0"}
    (v4,) = [block for block in blocks if block["cidr"] == "0.0.0.0/0"]
    assert set(v4["except"]) >= PRIVATE_RANGES


def test_an_empty_peer_list_admits_no_one():
    objs = render_objects("cpu", networkPolicy={"apiFrom": [], "metricsFrom": []})
    policy = one(objs, "NetworkPolicy")
    operator = chart_values("cpu")["networkPolicy"]["operatorFrom"]
    assert sorted(map(repr, ingress_peers(policy, HTTP_PORT))) == sorted(
        map(repr, [OWN_PODS, *operator])
    )
    assert ingress_peers(policy, METRICS_PORT) == [OWN_PODS]
    validate_all([policy])


def test_an_added_api_peer_reaches_the_serve_port_only():
    client = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "my-app"}},
        "podSelector": {"matchLabels": {"app": "my-client"}},
    }
    objs = render_objects("cpu", networkPolicy={"apiFrom": [client]})
    policy = one(objs, "NetworkPolicy")
    assert client in ingress_peers(policy, HTTP_PORT)
    for port in (DASHBOARD_PORT, METRICS_PORT, GCS_PORT):
        assert client not in ingress_peers(policy, port), port


def test_network_policy_can_be_turned_off():
    assert not by_kind(render_objects("cpu", networkPolicy={"enabled": False}), "NetworkPolicy")


# What is exposed


def test_api_service_exposes_the_serve_port_only(rendered):
    _, objs = rendered
    service = one(objs, "RayService")["spec"]["serveService"]
    (port,) = service["spec"]["ports"]
    assert port["name"] == "serve" and port["targetPort"] == HTTP_PORT
    # The metrics Service carries the metrics port alone; no Service carries the dashboard.
    for other in by_kind(objs, "Service"):
        assert [p["targetPort"] for p in other["spec"]["ports"]] == ["metrics"]


def test_ingress_routes_only_v1_to_the_serve_port():
    objs = render_objects(
        "cpu",
        ingress={"enabled": True, "hosts": [{"host": "a.example.com"}, {"host": "b.example"}]},
    )
    ingress = one(objs, "Ingress")
    validate_all([ingress])
    rules = ingress["spec"]["rules"]
    assert [rule["host"] for rule in rules] == ["a.example.com", "b.example"]
    for rule in rules:
        (path,) = rule["http"]["paths"]
        assert (path["path"], path["pathType"]) == ("/v1/", "Prefix")
        assert path["backend"]["service"] == {
            "name": f"{generate.RELEASE}-api",
            "port": {"name": "serve"},
        }
    assert "defaultBackend" not in ingress["spec"]
