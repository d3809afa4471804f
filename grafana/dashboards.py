"""The Grafana dashboards, as code (grafana-foundation-sdk).

`python -m grafana.dashboards` (`make generate`) writes each dashboard to grafana/<uid>.json and
the same file to helm/specserve/dashboards/<uid>.json, which the chart turns into a ConfigMap for
Grafana's sidecar. tests/deploy/test_dashboards.py checks that the committed files are what this
writes and what every query asks of Prometheus.

- `specserve-arms`, the A/B view: every arm side by side, from the router's metrics
  (service/specserve/metrics.py): acceptance, per-user speed and speedup over the baseline arm,
  latency, errors, traffic split, arm state, config revision and reloads.
- `specserve-engines`: vLLM's and Ray Serve's own metrics per arm (running and waiting requests,
  KV-cache usage, generated tokens, replicas).

The router in each node's HTTP proxy exports its own series (Ray labels them with its WorkerId)
and Kubernetes adds pod labels, so every query aggregates, with the helpers of grafana/promql.py:
counters summed, gauges maxed, histograms summed by `le`, by (namespace, model, arm) (Ray Serve's
series have no model: by (namespace, arm)). Locally there is no `namespace` label; the `namespace`
variable's All is `.*`, which matches the absent label. Queries use only the variables
`$namespace`, `$model`, `$arm` (always as `=~"$var"` matchers) and `$__rate_interval`.

The panels are defined in grafana/panels.py; this module lays them out in rows, adds the template
variables and the config-revision annotation, and renders and writes the JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardCursorSync,
    DashboardLinkType,
    VariableModel,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from grafana.panels import (
    BASELINE_ARM as BASELINE_ARM,  # the arm the arms dashboard's speedup compares against
)
from grafana.panels import (
    DATASOURCE,
    PanelBuilder,
    config_panels,
    engine_panels,
    latency_panels,
    load_panels,
    speculation_panels,
    speed_panels,
    traffic_panels,
)
from grafana.promql import ARM_WEIGHT, CONFIG_INFO, DEPLOYMENT, PER_MODEL, gauge_max

ROOT = Path(__file__).resolve().parent.parent
# The committed dashboards, and the Helm chart's copies (one ConfigMap each).
OUTPUT_DIRS = (ROOT / "grafana", ROOT / "helm" / "specserve" / "dashboards")
TAG = "specserve"


class PrometheusAnnotation(cogbuilder.Builder[AnnotationQuery]):
    """A Prometheus annotation query: one event per series, titled from its labels. The SDK's
    AnnotationQuery has no field for Grafana's `titleFormat` and friends; this adds them."""

    class Model(AnnotationQuery):
        def __init__(self, title_format: str, text_format: str, tag_keys: str, **kw) -> None:
            super().__init__(**kw)
            self.title_format, self.text_format, self.tag_keys = title_format, text_format, tag_keys

        def to_json(self) -> dict[str, object]:
            return {
                **super().to_json(),
                "titleFormat": self.title_format,
                "textFormat": self.text_format,
                "tagKeys": self.tag_keys,
                "useValueForTime": False,
            }

    def __init__(self, name: str, expr: str, *, title: str, text: str, tags: str) -> None:
        self._model = self.Model(
            title_format=title,
            text_format=text,
            tag_keys=tags,
            name=name,
            datasource=DATASOURCE,
            enable=True,
            icon_color="purple",
            expr=expr,
        )

    def build(self) -> AnnotationQuery:
        return self._model


def revision_annotation() -> PrometheusAnnotation:
    """A marker where a revision becomes active: its config_info series exists now but not one
    rate interval ago (at least one query step, so no change falls between two steps)."""
    active = gauge_max(CONFIG_INFO, DEPLOYMENT, f"{PER_MODEL}, revision")
    before = (
        f"max by ({PER_MODEL}, revision) ({CONFIG_INFO}{{{DEPLOYMENT}}} offset $__rate_interval)"
    )
    return PrometheusAnnotation(
        "Config revision",
        f"{active}\nunless\n{before}",
        title="config {{revision}}",
        text="Config revision {{revision}} of {{model}} became active.",
        tags="model",
    )


def variable(
    name: str, label: str, description: str, query_text: str
) -> dashboard_builders.QueryVariable:
    return (
        dashboard_builders.QueryVariable(name)
        .id(name)  # the SDK's default id is the same for every variable
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query_text)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def all_of(var: dashboard_builders.QueryVariable) -> dashboard_builders.QueryVariable:
    """All as `.*`, selected by default: it also matches series without the label."""
    return (
        var.include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def variables() -> list[cogbuilder.Builder[VariableModel]]:
    namespace = variable(
        "namespace",
        "Namespace",
        "Kubernetes namespace of the deployment (All also matches a local platform, whose series "
        "have no namespace label).",
        f"label_values({CONFIG_INFO}, namespace)",
    )
    model = variable(
        "model",
        "Model",
        "The served model (one router config per model).",
        f'label_values({CONFIG_INFO}{{namespace=~"$namespace"}}, model)',
    )
    arm = variable(
        "arm",
        "Arm",
        "The arms to show: every arm of the active config, weight 0 included.",
        f"label_values({ARM_WEIGHT}{{{DEPLOYMENT}}}, arm)",
    )
    return [
        dashboard_builders.DatasourceVariable("datasource")
        .id("datasource")
        .label("Data source")
        .type("prometheus"),
        all_of(namespace),
        model,
        all_of(arm).multi(True),
    ]


def dashboard(
    uid: str, title: str, description: str, rows: list[tuple[str, list[PanelBuilder]]]
) -> dashboard_builders.Dashboard:
    board = (
        dashboard_builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .link(
            dashboard_builders.DashboardLink("specserve")
            .type(DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .variables(variables())
        .annotation(revision_annotation())
    )
    for row_title, row_panels in rows:
        # Expanded rows: their panels follow them at the top level (Grafana's layout).
        board.with_row(dashboard_builders.Row(row_title).collapsed(False))
        for panel in row_panels:
            board.with_panel(panel)
    return board


def arms_dashboard() -> dashboard_builders.Dashboard:
    return dashboard(
        "specserve-arms",
        "specserve: arms side by side",
        "The A/B/n view: the speculative-decoding arms of one model side by side, from the "
        "router's per-arm metrics. Annotations mark config revision changes.",
        [
            ("Speculative decoding", speculation_panels()),
            ("Speed", speed_panels()),
            ("Latency", latency_panels()),
            ("Traffic and errors", traffic_panels()),
            ("Configuration", config_panels()),
        ],
    )


def engines_dashboard() -> dashboard_builders.Dashboard:
    return dashboard(
        "specserve-engines",
        "specserve: engines per arm",
        "Engine health per arm from vLLM's and Ray Serve's own metrics. vLLM's series carry no "
        "arm label: each is matched to its arm through the Ray Serve replica it comes from.",
        [("vLLM engines", engine_panels()), ("Load and replicas", load_panels())],
    )


def build() -> list[Dashboard]:
    dashboards = [arms_dashboard().build(), engines_dashboard().build()]
    for board in dashboards:
        # Stable ids in layout order (Grafana needs them unique within a dashboard).
        for panel_id, panel in enumerate(board.panels or [], start=1):
            panel.id_val = panel_id
    return dashboards


def to_json(board: Dashboard) -> str:
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render() -> dict[str, str]:
    """{file name: JSON text} of every dashboard, as the files under OUTPUT_DIRS hold them."""
    return {f"{board.uid}.json": to_json(board) for board in build()}


def panels(board: dict) -> Iterator[dict]:
    """Every panel of a dashboard's JSON, rows' nested panels included, rows themselves not."""
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
        else:
            yield panel


def expressions() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every query in every dashboard, the revision
    annotations' too (titled after the annotation); `resolve` makes them evaluable."""
    for text in render().values():
        board = json.loads(text)
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                yield f"{annotation['name']} (annotation)", annotation["expr"]
        for panel in panels(board):
            for target in panel.get("targets", []):
                yield panel["title"], target["expr"]


def write() -> list[Path]:
    files, written = render(), []
    for directory in OUTPUT_DIRS:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = directory / name
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        print(path.relative_to(ROOT), file=sys.stderr)
