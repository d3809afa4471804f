"""The Prometheus alert rules: valid for promtool, passing their promtool unit tests, written
against metrics specserve exports, and each with a severity and a runbook section."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specserve.metrics import exported_names
from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm/specserve/rules/specserve-rules.yaml"
RULE_TESTS = Path(__file__).resolve().parent / "rules/specserve-rules.test.yaml"
RUNBOOK = ROOT / "docs/runbook.md"
RUNBOOK_LINK = re.compile(r"docs/runbook\.md#([a-z0-9_-]+)")
METRIC = re.compile(r"\b\w*specserve_\w+")
GROUPING = re.compile(r"\b(by|on|without|ignoring)\s*\(([^)]*)\)")
LABEL_REF = re.compile(r"\$labels\.(\w+)")
# Labels every series carries after aggregation: one alert per deployment and model.
ALWAYS_GROUPED = {"namespace", "model"}


def load_alerts() -> list[dict]:
    rules = [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]
    assert rules, "no rules"
    return rules


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {
        github_anchor(line.lstrip("#"))
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("#")
    }


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool not installed (apt-get install prometheus)")
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_rules(promtool):
    result = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests(promtool):
    result = run(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_file_is_a_prometheus_rule_spec():
    # The chart puts the file under a PrometheusRule's spec, which has `groups` only.
    assert set(yaml.safe_load(RULES.read_text())) == {"groups"}


def test_alerts_only_uniquely_named():
    names = [rule.get("alert") for rule in load_alerts()]
    assert all(names), "recording rules do not belong here: dashboards must work without them"
    assert len(set(names)) == len(names), f"duplicate alert names: {names}"
    assert all(name.startswith("Specserve") for name in names), names


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_alert_shape(rule):
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), "a `for` keeps one bad scrape quiet"
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    assert RUNBOOK_LINK.fullmatch(annotations["runbook_url"]), annotations["runbook_url"]


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_alert_uses_exported_metrics_only(rule):
    used = set(METRIC.findall(rule["expr"]))
    assert used, "no specserve metric in the expression"
    assert used <= exported_names(), f"not exported: {sorted(used - exported_names())}"


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_alert_aggregates_across_replicas(rule):
    # Series differ by Ray's WorkerId and the pod: every grouping names the labels it keeps.
    groupings = GROUPING.findall(rule["expr"])
    assert groupings, "no aggregation: one alert per router replica"
    for keyword, labels in groupings:
        assert keyword in ("by", "on"), f"`{keyword}` keeps Ray's and Kubernetes' labels"
        assert {label.strip() for label in labels.split(",")} >= ALWAYS_GROUPED, labels


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_annotations_use_labels_the_alert_has(rule):
    kept = {
        label.strip() for _, labels in GROUPING.findall(rule["expr"]) for label in labels.split(",")
    }
    referenced = {
        label for text in rule["annotations"].values() for label in LABEL_REF.findall(text)
    }
    assert referenced <= kept - {"le"}, f"never set: {sorted(referenced - kept)}"


def test_runbook_has_a_section_per_alert():
    anchors = runbook_anchors()
    links = {
        rule["alert"]: RUNBOOK_LINK.fullmatch(rule["annotations"]["runbook_url"]).group(1)
        for rule in load_alerts()
    }
    assert set(links.values()) <= anchors, f"no such heading: {set(links.values()) - anchors}"
    assert len(set(links.values())) == len(links), "alerts share a runbook section"
    for name, anchor in links.items():
        assert anchor == github_anchor(name), f"{name} links to another alert's section"
    sections = {
        line.removeprefix("## ").strip()
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## Specserve")
    }
    assert sections == set(links), "runbook sections without an alert, or the reverse"


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [
        case
        for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in group["alert_rule_test"]
    ]
    for rule in load_alerts():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case.get("exp_alerts") for case in mine), f"{rule['alert']} never fires"
        assert any(not case.get("exp_alerts") for case in mine), f"{rule['alert']} always fires"


def test_unit_tests_feed_exported_metrics_only():
    series = [
        entry["series"]
        for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for entry in group["input_series"]
    ]
    names = {re.match(r"[\w:]+", text).group(0) for text in series}
    assert names <= exported_names(), f"not exported: {sorted(names - exported_names())}"
    assert any('WorkerId="' in text for text in series), "series need Ray's replica labels"
