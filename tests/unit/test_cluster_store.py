"""The decisions of `specserve config apply / history / rollback`, without any API server: which
history records go, which revision a rollback restores, how arm applications merge into a
RayService's serveConfigV2. The commands against the Kubernetes API are in tests/deploy/."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from specserve.cli import main
from specserve.config import cluster_store
from specserve.config.cluster_store import (
    format_time,
    history_configmap,
    last_written,
    load_serve_config,
    parse_time,
    record_of,
)
from specserve.config.schema import parse_config, revision_of
from specserve.config.serve_config import (
    ROUTER_APP_NAME,
    application_changes,
    dump_serve_config,
    merge_arm_applications,
    serve_config,
)
from specserve.config.store import (
    Record,
    StoreError,
    history_table,
    next_applied_at,
    previous_record,
    records_to_prune,
    resolve_revision,
)

CONFIG = """\
model: {name: m, source: s}
arms:
  - {name: a, weight: 1}
  - name: b
    weight: 3
    speculative: {method: ngram, num_speculative_tokens: 3}
"""
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def record(revision: str, minutes: float, text: str = CONFIG) -> Record:
    return Record(
        name=f"specserve-config-{revision}",
        revision=revision,
        applied_at=T0 + timedelta(minutes=minutes),
        text=text,
    )


# History bounds.


def test_prune_keeps_the_newest_and_deletes_the_oldest_beyond_keep():
    records = [record(f"r{i}", i) for i in range(5)]
    pruned = records_to_prune(records, keep=3, live_revision="r4")
    assert [r.revision for r in pruned] == ["r1", "r0"]
    assert records_to_prune(records, keep=5, live_revision="r4") == []


def test_prune_never_deletes_the_live_revision():
    # After a rollback by hand the live record may be old: it stays, the others make room.
    records = [record(f"r{i}", i) for i in range(5)]
    pruned = records_to_prune(records, keep=2, live_revision="r0")
    assert [r.revision for r in pruned] == ["r2", "r1"]
    with pytest.raises(ValueError):
        records_to_prune(records, keep=0, live_revision="r4")


def test_applied_at_moves_forward_even_when_the_clock_is_behind():
    records = [record("r0", 0), record("r1", 5)]
    assert next_applied_at(T0 + timedelta(minutes=10), records) == T0 + timedelta(minutes=10)
    behind = next_applied_at(T0 + timedelta(minutes=1), records)
    assert behind == T0 + timedelta(minutes=5, microseconds=1)
    assert next_applied_at(T0, []) == T0


def test_times_are_rfc3339_utc_and_keep_their_order_within_a_second():
    first, second = T0, T0 + timedelta(microseconds=250)
    assert format_time(first) == "2025-03-01T12:00:00.000000Z"
    assert parse_time(format_time(second)) == second
    assert format_time(first) < format_time(second)
    assert parse_time("2025-03-01T13:00:00+01:00") == T0


def test_last_written_is_the_newest_managed_fields_time():
    obj = {
        "metadata": {
            "creationTimestamp": "2025-03-01T10:00:00Z",
            "managedFields": [
                {"manager": "helm", "time": "2025-03-01T11:00:00Z"},
                {"manager": "kubectl-edit", "time": "2025-03-01T12:00:00Z"},
            ],
        }
    }
    assert last_written(obj) == T0
    assert last_written({"metadata": {"creationTimestamp": "2025-03-01T12:00:00Z"}}) == T0
    assert last_written({"metadata": {}}) is None


def test_history_record_is_immutable_labelled_and_named_by_revision():
    body = history_configmap("rel-specserve-config", "rel", CONFIG, T0)
    revision = revision_of(CONFIG.encode())
    assert body["metadata"]["name"] == f"rel-specserve-config-{revision}"
    assert body["immutable"] is True
    assert body["data"] == {"config.yaml": CONFIG}
    assert body["metadata"]["labels"] == {
        "app.kubernetes.io/name": "specserve",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/component": "config-history",
        "specserve.io/revision": revision,
    }
    assert parse_time(body["metadata"]["annotations"]["specserve.io/applied-at"]) == T0
    again = record_of(body)
    assert (again.revision, again.applied_at, again.text) == (revision, T0, CONFIG)


def test_record_revision_is_the_hash_of_its_bytes_not_its_label():
    body = history_configmap("c", "rel", CONFIG, T0)
    body["metadata"]["labels"]["specserve.io/revision"] = "000000000000"
    assert record_of(body).revision == revision_of(CONFIG.encode())


# Which revision a rollback restores.


def test_rollback_default_is_the_record_applied_before_the_live_one():
    records = [record("aaa111", 0), record("bbb222", 1), record("ccc333", 2)]
    assert previous_record(records, "ccc333").revision == "bbb222"
    # After rolling back to bbb222 (its applied-at moves to now), the default goes forward again.
    records[1] = record("bbb222", 3)
    assert previous_record(records, "bbb222").revision == "ccc333"


def test_rollback_default_without_an_earlier_record_is_an_error():
    with pytest.raises(StoreError, match="only ccc333"):
        previous_record([record("ccc333", 0)], "ccc333")
    with pytest.raises(StoreError, match="no history records"):
        previous_record([], "ccc333")


def test_rollback_to_takes_a_revision_or_a_unique_prefix():
    records = [record("3f2a0c1d9e8b", 0), record("3f9b11aa0000", 1), record("6ffeb893ab1b", 2)]
    assert resolve_revision(records, "6ffeb893ab1b").revision == "6ffeb893ab1b"
    assert resolve_revision(records, "6f").revision == "6ffeb893ab1b"
    assert resolve_revision(records, "3F2A").revision == "3f2a0c1d9e8b"


def test_rollback_to_an_ambiguous_or_unknown_revision_lists_the_known_ones():
    records = [record("3f2a0c1d9e8b", 0), record("3f9b11aa0000", 1), record("6ffeb893ab1b", 2)]
    with pytest.raises(StoreError) as ambiguous:
        resolve_revision(records, "3f")
    assert "ambiguous (matches 3f2a0c1d9e8b, 3f9b11aa0000)" in str(ambiguous.value)
    with pytest.raises(StoreError) as unknown:
        resolve_revision(records, "abc")
    message = str(unknown.value)
    assert "no revision 'abc'" in message
    assert "known revisions: 6ffeb893ab1b, 3f9b11aa0000, 3f2a0c1d9e8b" in message
    with pytest.raises(StoreError, match="name a revision"):
        resolve_revision(records, "")


# serveConfigV2: the arm applications change, nothing else does.


def running_document(text: str = CONFIG, **kwargs) -> dict:
    """As the chart renders it: serve_config() with the chart's own router settings."""
    document = serve_config(parse_config(text), config_poll_s=2.5, router_replicas=3, **kwargs)
    document["logging_config"] = {"encoding": "JSON"}  # a key these commands do not know
    return document


def test_merge_replaces_the_arms_and_keeps_the_router_and_top_level_keys():
    document = running_document()
    before = copy.deepcopy(document)
    new = CONFIG.replace("num_speculative_tokens: 3", "num_speculative_tokens: 5") + (
        "  - {name: c, weight: 1}\n"
    )
    merged = merge_arm_applications(document, parse_config(new))
    assert document == before  # the input is not modified
    assert {k: v for k, v in merged.items() if k != "applications"} == {
        k: v for k, v in before.items() if k != "applications"
    }
    assert merged["applications"][0] == before["applications"][0]
    assert merged["applications"][0]["name"] == ROUTER_APP_NAME
    assert merged["applications"][0]["args"]["replicas"] == 3
    assert [app["name"] for app in merged["applications"]] == [
        ROUTER_APP_NAME,
        "arm-a",
        "arm-b",
        "arm-c",
    ]
    arm_b = merged["applications"][2]
    assert arm_b["args"]["arm"]["speculative"]["num_speculative_tokens"] == 5
    changes = application_changes(document, merged)
    assert changes.redeployed == ("arm-b", "arm-c")
    assert changes.removed == ()
    # The document survives a YAML round trip (serveConfigV2 is a string).
    dumped = dump_serve_config(merged)
    assert yaml.safe_load(dumped) == merged


def test_merge_removes_an_arm_and_keeps_other_applications_in_place():
    document = running_document()
    extra = {"name": "dashboard", "route_prefix": "/dash", "import_path": "x:y"}
    document["applications"].append(extra)
    merged = merge_arm_applications(document, parse_config(CONFIG.split("  - name: b")[0]))
    assert [app["name"] for app in merged["applications"]] == [
        ROUTER_APP_NAME,
        "arm-a",
        "dashboard",
    ]
    assert merged["applications"][-1] == extra
    changes = application_changes(document, merged)
    assert (changes.redeployed, changes.removed) == ((), ("arm-b",))


def test_merge_keeps_arms_exposed_when_they_were():
    document = running_document(expose_arms=True)
    merged = merge_arm_applications(
        document, parse_config(CONFIG.replace("weight: 3", "weight: 7"))
    )
    assert merged == document


def test_no_patch_when_only_weights_routing_or_limits_change():
    document = running_document()
    live_only = CONFIG.replace("weight: 3", "weight: 9") + "limits: {max_tokens: 64}\n"
    merged = merge_arm_applications(document, parse_config(live_only))
    assert not application_changes(document, merged)
    assert merged == document


def test_key_order_and_yaml_layout_of_the_running_document_do_not_count_as_changes():
    # The chart renders serveConfigV2 with Helm's toYaml: keys sorted, other layout.
    rendered = yaml.safe_dump(running_document(), sort_keys=True, default_flow_style=True)
    document = load_serve_config(rendered, "specserve")
    assert not application_changes(document, merge_arm_applications(document, parse_config(CONFIG)))


def test_model_change_redeploys_every_arm():
    document = running_document()
    merged = merge_arm_applications(
        document, parse_config(CONFIG.replace("source: s", "source: t"))
    )
    assert application_changes(document, merged).redeployed == ("arm-a", "arm-b")


def test_a_serve_config_without_applications_is_an_error():
    with pytest.raises(StoreError, match="no `applications`"):
        load_serve_config("proxy_location: EveryNode\n", "specserve")
    with pytest.raises(StoreError, match="not valid YAML"):
        load_serve_config("applications: [", "specserve")


def test_history_table_is_newest_first_with_weights_and_the_live_mark():
    other = CONFIG.replace("weight: 3", "weight: 5")
    records = [record("aaa111aaa111", 0), record("bbb222bbb222", 1, other)]
    lines = history_table(records, live_revision="aaa111aaa111")
    assert lines[0].split() == ["REVISION", "APPLIED", "AT", "LIVE", "ARMS"]
    assert lines[1].split() == ["bbb222bbb222", "2025-03-01T12:01:00Z", "a=1", "b=5"]
    assert lines[2].split() == ["aaa111aaa111", "2025-03-01T12:00:00Z", "live", "a=1", "b=3"]
    broken = history_table([record("ccc", 0, "arms: []")], live_revision="x")
    assert "(invalid:" in broken[1]


# The CLI validates before it connects.


def test_apply_of_an_invalid_file_never_reaches_the_cluster(tmp_path, capsys, monkeypatch):
    def connect(**kwargs):
        raise AssertionError("connected to the cluster with an invalid file")

    monkeypatch.setattr(cluster_store.Cluster, "connect", connect)
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("weight: 3", "weight: -3"))
    assert main(["config", "apply", str(bad)]) == 2
    assert "arms.1.weight" in capsys.readouterr().err
    assert main(["config", "apply", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_apply_keep_must_be_positive(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG)
    with pytest.raises(SystemExit):
        main(["config", "apply", str(good), "--keep", "0"])
    assert "--keep" in capsys.readouterr().err


def test_without_a_kubeconfig_outside_a_pod_the_error_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["config", "history"]) == 2
    assert f"no kubeconfig at {tmp_path / 'absent'} and not running in a pod" in (
        capsys.readouterr().err
    )


def test_replicas_or_queue_settings_rescale_an_arm_in_place():
    document = running_document()
    scaled = CONFIG.replace("{name: a, weight: 1}", "{name: a, weight: 1, replicas: 2}")
    assert scaled != CONFIG
    changes = application_changes(document, merge_arm_applications(document, parse_config(scaled)))
    assert (changes.redeployed, changes.rescaled, changes.removed) == ((), ("arm-a",), ())
