"""The Grafana dashboards (grafana/dashboards.py, their PromQL in grafana/promql.py): the committed
files and the chart's copies are what the generator writes, and every query is PromQL over series
specserve (or the Ray Serve and vLLM metrics the dashboards declare) exports, aggregated across
router replicas and pods."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from grafana import dashboards, promql
from specserve.metrics import exported_names
from tests.deploy.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
CHART_DASHBOARDS = ROOT / "helm" / "specserve" / "dashboards"


RENDERED: dict[str, str] = dashboards.render()
BOARDS = {name: json.loads(text) for name, text in RENDERED.items()}
ALLOWED_METRICS = exported_names() | promql.ENGINE_METRICS

STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
LABEL_LIST = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENTIFIER = re.compile(r"(?<![\w$])([a-zA-Z_]\w*)\b(?!\s*\()")
KEYWORDS = {"group_left", "group_right", "or", "and", "unless", "offset", "bool"}
GROUPING = re.compile(r"\b(by|on|without|ignoring)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"\b([a-zA-Z_]\w*)\{([^}]*)\}")
VARIABLE_REF = re.compile(r"\$(?:\{(\w+)\}|([a-zA-Z_]\w*))")
REGEX_MATCHER = re.compile(r'\w+=~"([^"]*)"')


class Query(NamedTuple):
    board: str
    title: str
    expr: str
    legend: str

    @property
    def per_arm(self) -> bool:
        return "$arm" in self.expr or "{{arm}}" in self.legend


def all_queries() -> list[Query]:
    found = []
    for board in BOARDS.values():
        for annotation in board["annotations"]["list"]:
            title = f"{annotation['name']} (annotation)"
            found.append(Query(board["uid"], title, annotation["expr"], ""))
        for panel in dashboards.panels(board):
            for target in panel["targets"]:
                found.append(
                    Query(board["uid"], panel["title"], target["expr"], target["legendFormat"])
                )
    return found


QUERIES = all_queries()
QUERY_IDS = [f"{q.board}:{q.title}:{i}" for i, q in enumerate(QUERIES)]


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects: identifiers that are not functions, keywords,
    label names (in matchers and label lists), durations or strings."""
    text = STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = LABEL_LIST.sub("", text)
    text = re.sub(r"\boffset\s+\$?\w+", "", text)
    return {name for name in IDENTIFIER.findall(text) if name not in KEYWORDS}


def panel_expr(title: str) -> str:
    return next(q.expr for q in QUERIES if q.title == title)


# -- files -------------------------------------------------------------------------------------


def test_committed_dashboards_are_generated():
    assert set(RENDERED) == {"specserve-arms.json", "specserve-engines.json"}
    assert {p.name for p in GRAFANA.glob("*.json")} == set(RENDERED), "run `make generate`"
    for name, text in RENDERED.items():
        assert (GRAFANA / name).read_text() == text, f"{name} is stale: run `make generate`"


def test_chart_copies_are_identical():
    assert {p.name for p in CHART_DASHBOARDS.glob("*.json")} == set(RENDERED)
    for name in RENDERED:
        assert (CHART_DASHBOARDS / name).read_bytes() == (GRAFANA / name).read_bytes(), name


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_dashboard_fits_a_configmap(name):
    # A ConfigMap holds at most 1 MiB; stay far below it.
    assert len(RENDERED[name].encode()) < 256 * 1024
    assert BOARDS[name]["uid"] == name.removesuffix(".json")
    assert len(BOARDS[name]["uid"]) <= 40  # Grafana's limit


def test_expressions_lists_every_query():
    assert sorted(dashboards.expressions()) == sorted((q.title, q.expr) for q in QUERIES)


# -- dashboard structure -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_template_variables(name):
    variables = {v["name"]: v for v in BOARDS[name]["templating"]["list"]}
    assert list(variables) == ["datasource", *promql.VARIABLES]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    namespace, model, arm = (variables[n] for n in promql.VARIABLES)
    assert namespace["query"] == f"label_values({promql.CONFIG_INFO}, namespace)"
    # All must match series without a namespace label (a local platform).
    assert namespace["includeAll"] and namespace["allValue"] == ".*"
    assert re.fullmatch(rf"label_values\({promql.CONFIG_INFO}(\{{.*\}})?, model\)", model["query"])
    assert re.fullmatch(
        rf'label_values\({promql.ARM_WEIGHT}\{{.*model=~"\$model".*\}}, arm\)', arm["query"]
    )
    assert arm["multi"] and arm["includeAll"] and arm["allValue"] == ".*"
    for variable in (namespace, model, arm):
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == "${datasource}"
        assert re.match(r"label_values\((\w+)", variable["query"]).group(1) in exported_names()
    assert len({v["id"] for v in variables.values()}) == len(variables)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_revision_annotation(name):
    annotations = BOARDS[name]["annotations"]["list"]
    revision = [a for a in annotations if promql.CONFIG_INFO in a.get("expr", "")]
    assert len(revision) == 1
    assert "{{revision}}" in revision[0]["titleFormat"]
    assert revision[0]["enable"] and revision[0]["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_panels(name):
    board = BOARDS[name]
    panels = list(dashboards.panels(board))
    assert panels
    titles = [p["title"] for p in panels]
    assert len(set(titles)) == len(titles), "duplicate panel titles"
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids) and 0 not in ids
    for panel in panels:
        assert panel.get("description", "").strip(), f"{panel['title']}: no description"
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert all(ref_ids) and len(set(ref_ids)) == len(ref_ids)
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0


def test_arms_dashboard_covers_the_ab_view():
    titles = {p["title"] for p in dashboards.panels(BOARDS["specserve-arms.json"])}
    assert {
        "Acceptance rate",
        "Mean acceptance length",
        "Acceptance by draft position",
        "Per-user output speed (p50)",
        f"Speedup over {dashboards.BASELINE_ARM}",
        "Time to first token",
        "Time per output token",
        "End-to-end latency",
        "Error rate by outcome",
        "Traffic share: configured vs observed",
        "Requests per second",
        "Output tokens per second",
        "Routing fallbacks",
        "Arm running state",
        "Config revision",
        "Config reloads",
    } <= titles
    engines = {p["title"] for p in dashboards.panels(BOARDS["specserve-engines.json"])}
    assert {"Running requests", "Waiting requests", "KV-cache usage"} <= engines


def test_speedup_names_its_baseline():
    baseline = dashboards.BASELINE_ARM
    panel = next(
        p
        for p in dashboards.panels(BOARDS["specserve-arms.json"])
        if p["title"] == f"Speedup over {baseline}"
    )
    assert f"`{baseline}`" in panel["description"]
    (target,) = panel["targets"]
    assert f'arm="{baseline}"' in target["expr"]
    assert "on (namespace, model) group_left" in target["expr"]


# -- queries -------------------------------------------------------------------------------------


@pytest.mark.parametrize("query", QUERIES, ids=QUERY_IDS)
def test_query_uses_known_metrics_only(query):
    used = metric_names(query.expr)
    assert used, "no metric in the expression"
    assert used <= ALLOWED_METRICS, f"unknown: {sorted(used - ALLOWED_METRICS)}"


def test_every_listed_engine_metric_is_used():
    used = set().union(*(metric_names(q.expr) for q in QUERIES))
    assert used >= promql.ENGINE_METRICS, sorted(promql.ENGINE_METRICS - used)


@pytest.mark.parametrize("query", QUERIES, ids=QUERY_IDS)
def test_query_aggregates_across_replicas(query):
    # Series differ by Ray's WorkerId and the pod: every grouping names the labels it keeps.
    groupings = [
        (keyword, {label.strip() for label in labels.split(",")})
        for keyword, labels in GROUPING.findall(query.expr)
    ]
    assert any(keyword == "by" for keyword, _ in groupings), "no aggregation"
    for keyword, labels in groupings:
        assert keyword in ("by", "on"), f"`{keyword}` keeps Ray's and Kubernetes' labels"
        assert "namespace" in labels, f"{keyword} ({', '.join(sorted(labels))}) mixes deployments"
    if query.per_arm:
        assert any(keyword == "by" and "arm" in labels for keyword, labels in groupings)


@pytest.mark.parametrize("query", QUERIES, ids=QUERY_IDS)
def test_query_filters_by_the_variables(query):
    refs = {named or plain for named, plain in VARIABLE_REF.findall(query.expr)}
    assert refs <= {*promql.VARIABLES, "__rate_interval"}, refs
    # Each variable only inside a regex matcher (`label=~"$var"`): All and multi-values are regexes.
    in_matchers = " ".join(REGEX_MATCHER.findall(query.expr))
    for name in promql.VARIABLES:
        assert query.expr.count(f"${name}") == in_matchers.count(f"${name}"), name
    for metric, matchers in SELECTOR.findall(query.expr):
        assert 'namespace=~"$namespace"' in matchers, metric
        if metric.startswith("ray_specserve_"):
            assert 'model=~"$model"' in matchers, metric
    assert not (metric_names(query.expr) - {m for m, _ in SELECTOR.findall(query.expr)}), (
        "a series without the namespace filter"
    )


def test_expressions_are_valid_promql(tmp_path):
    promtool = require_tool("promtool")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": promql.resolve(expr)}
        for i, (_, expr) in enumerate(dashboards.expressions())
    ]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_queries_compute_per_arm_figures_on_series_shaped_like_the_platforms(tmp_path):
    """Evaluated by promtool on series labelled as Ray exports them (two router replicas, no
    namespace label as on a local platform): the per-arm join of vLLM's series, the speedup
    over the baseline, acceptance where an arm accepted nothing, the configured share."""
    promtool = require_tool("promtool")
    d = promql
    workers = ('WorkerId="w1", SessionName="s"', 'WorkerId="w2", SessionName="s"')
    series: list[dict[str, str]] = []

    def add(metric: str, labels: str, values: str) -> None:
        series.append({"series": f"{metric}{{{labels}}}", "values": values})

    # vLLM engines of two arms, and Ray Serve's gauges naming the arm of each replica.
    for arm, replica, running in (("eagle3", "abc", 3), ("no-spec", "def", 2)):
        add(d.VLLM_RUNNING, f'model_name="m", engine="0", ReplicaId="{replica}"', f"{running}x10")
        add(d.SERVE_PROCESSING_QUERIES, f'application="arm-{arm}", replica="{replica}"', "1x10")
    add(d.SERVE_PROCESSING_QUERIES, 'application="specserve", replica="xyz"', "4x10")
    for worker in workers:
        # Time per output token: no-spec's all in (0.25, 0.75] s (p50 0.5), eagle3's in
        # (0, 0.25] s (p50 0.125): 4 times as fast.
        for arm, slow_from in (("no-spec", 0.75), ("eagle3", 0.25)):
            for le in ("0.25", "0.75", "+Inf"):
                per_min = 0 if le != "+Inf" and float(le) < slow_from else 10
                labels = f'model="m", arm="{arm}", le="{le}", {worker}'
                add(d.TPOT_BUCKETS, labels, f"0+{per_min}x10")
        for arm, weight in (("eagle3", 3), ("no-spec", 1)):
            add(d.ARM_WEIGHT, f'model="m", arm="{arm}", {worker}', f"{weight}x10")
        # ngram drafts but never accepted: it has no accepted series at all.
        add(d.SPEC_DRAFT_TOKENS, f'model="m", arm="eagle3", {worker}', "0+100x10")
        add(d.SPEC_ACCEPTED, f'model="m", arm="eagle3", {worker}', "0+60x10")
        add(d.SPEC_DRAFT_TOKENS, f'model="m", arm="ngram", {worker}', "0+100x10")

    expected = {
        "Running requests": {"eagle3": 3, "no-spec": 2},
        f"Speedup over {dashboards.BASELINE_ARM}": {"eagle3": 4, "no-spec": 1},
        "Acceptance rate": {"eagle3": 0.6, "ngram": 0},
        "Traffic share: configured vs observed": {"eagle3": 0.75, "no-spec": 0.25},
    }
    titles = list(expected)
    rules = [
        {"record": f"panel:{i}", "expr": promql.resolve(panel_expr(title))}
        for i, title in enumerate(titles)
    ]
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]})
    )
    cases = [
        {
            "expr": f"panel:{i}",
            "eval_time": "5m",
            "exp_samples": [
                {"labels": f'panel:{i}{{model="m", arm="{arm}"}}', "value": value}
                for arm, value in expected[title].items()
            ],
        }
        for i, title in enumerate(titles)
    ]
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run(
        [promtool, "test", "rules", "test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
