"""The Grafana dashboards, as code (grafana-foundation-sdk).

`python grafana/dashboards.py` (`make generate`) writes each dashboard to grafana/<uid>.json and
the same file to helm/specserve/dashboards/<uid>.json, which the chart turns into a ConfigMap for
Grafana's sidecar. tests/deploy/test_dashboards.py checks that the committed files are what this
writes and what every query asks of Prometheus.

- `specserve-arms`, the A/B view: every arm side by side, from the router's metrics
  (service/specserve/metrics.py): acceptance, per-user speed and speedup over the baseline arm,
  latency, errors, traffic split, arm state, config revision and reloads.
- `specserve-engines`: vLLM's and Ray Serve's own metrics per arm (running and waiting requests,
  KV-cache usage, generated tokens, replicas).

Each router replica exports its own series (Ray labels them with its WorkerId) and Kubernetes adds
pod labels, so every query aggregates: counters summed, gauges maxed, histograms summed by `le`,
by (namespace, model, arm) (Ray Serve's series have no model: by (namespace, arm)). Locally there
is no `namespace` label; the `namespace` variable's All is `.*`, which matches the absent label.
Queries use only the variables `$namespace`, `$model`, `$arm` (always as `=~"$var"` matchers) and
`$__rate_interval`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, prometheus
from grafana_foundation_sdk.models.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DynamicConfigValue,
    ValueMap,
    ValueMappingResult,
    VariableModel,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from specserve import metrics
from specserve.serve_config import ARM_APP_PREFIX

ROOT = Path(__file__).resolve().parent.parent
# The committed dashboards, and the Helm chart's copies (one ConfigMap each).
OUTPUT_DIRS = (ROOT / "grafana", ROOT / "helm" / "specserve" / "dashboards")
TAG = "specserve"

# Every panel reads the Prometheus the `datasource` variable names: the files load in any Grafana.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# The template variables queries may use, always as `label=~"$name"`.
VARIABLES = ("namespace", "model", "arm")
# What `resolve` puts in their place to evaluate a query outside Grafana.
EVALUATION_VALUES = {"namespace": ".*", "model": ".*", "arm": ".*"}
# The arm the speedup panel divides by: the configs name their arm without speculation so.
BASELINE_ARM = "no-spec"


def _series(name: str, suffix: str = "") -> str:
    """The name Prometheus scrapes for a router metric (Ray puts `ray_` in front)."""
    return metrics.EXPORT_PREFIX + name + suffix


REQUESTS = _series(metrics.REQUESTS, "_total")
ARM_SELECTIONS = _series(metrics.ARM_SELECTIONS, "_total")
ROUTING_FALLBACKS = _series(metrics.ROUTING_FALLBACKS, "_total")
OUTPUT_TOKENS = _series(metrics.OUTPUT_TOKENS, "_total")
SPEC_DRAFTS = _series(metrics.SPEC_DRAFTS, "_total")
SPEC_DRAFT_TOKENS = _series(metrics.SPEC_DRAFT_TOKENS, "_total")
SPEC_ACCEPTED = _series(metrics.SPEC_ACCEPTED_TOKENS, "_total")
SPEC_ACCEPTED_PER_POSITION = _series(metrics.SPEC_ACCEPTED_PER_POSITION, "_total")
CONFIG_RELOADS = _series(metrics.CONFIG_RELOADS, "_total")
TTFT_BUCKETS = _series(metrics.TIME_TO_FIRST_TOKEN, "_bucket")
TPOT_BUCKETS = _series(metrics.TIME_PER_OUTPUT_TOKEN, "_bucket")
E2E_BUCKETS = _series(metrics.E2E_LATENCY, "_bucket")
ARM_WEIGHT = _series(metrics.ARM_WEIGHT)
ARM_RUNNING = _series(metrics.ARM_RUNNING)
CONFIG_INFO = _series(metrics.CONFIG_INFO)
CONFIG_LAST_RELOAD_SUCCESS = _series(metrics.CONFIG_LAST_RELOAD_SUCCESS)

# Ray Serve's and vLLM's own series the engine dashboard reads (exported through Ray's metrics
# agent: `vllm:` becomes `ray_vllm_`). vLLM labels its series with the public model name
# (`model_name`, the same for every arm) and the Serve replica (`ReplicaId`), not with the arm;
# Ray Serve labels its replicas' series with `replica` (the same id) and `application`
# (`arm-<arm>` for an arm's engine), which `per_arm_engine` joins on.
SERVE_PROCESSING_QUERIES = "ray_serve_replica_processing_queries"
VLLM_RUNNING = "ray_vllm_num_requests_running"
VLLM_WAITING = "ray_vllm_num_requests_waiting"
VLLM_KV_CACHE_USAGE = "ray_vllm_kv_cache_usage_perc"
VLLM_GENERATION_TOKENS = "ray_vllm_generation_tokens_total"
ENGINE_METRICS = frozenset(
    {
        SERVE_PROCESSING_QUERIES,
        VLLM_RUNNING,
        VLLM_WAITING,
        VLLM_KV_CACHE_USAGE,
        VLLM_GENERATION_TOKENS,
    }
)

# -- PromQL -----------------------------------------------------------------------------------

DEPLOYMENT = 'namespace=~"$namespace", model=~"$model"'
ARMS = DEPLOYMENT + ', arm=~"$arm"'
ENGINES = 'namespace=~"$namespace", model_name=~"$model"'
PER_MODEL = "namespace, model"
PER_ARM = "namespace, model, arm"
WINDOW = "[$__rate_interval]"
# Requests routed by the weights (directly or through a sticky key); overrides ignore weights.
BY_WEIGHT = f'selected_by=~"{metrics.SELECTED_BY_WEIGHT}|{metrics.SELECTED_BY_STICKY}"'


def rate_sum(series: str, selector: str = ARMS, by: str = PER_ARM) -> str:
    return f"sum by ({by}) (rate({series}{{{selector}}}{WINDOW}))"


def gauge_max(series: str, selector: str = ARMS, by: str = PER_ARM) -> str:
    return f"max by ({by}) ({series}{{{selector}}})"


def quantile(q: float, buckets: str, selector: str = ARMS, by: str = PER_ARM) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({buckets}{{{selector}}}{WINDOW})))"


def accepted_per(denominator: str) -> str:
    """Accepted draft tokens per `denominator` (draft tokens or drafts), per arm. An arm that
    accepted nothing has no accepted series (Ray's counters skip increments of 0): 0, not a gap.
    Arms without speculation have neither and show nothing."""
    accepted, total = rate_sum(SPEC_ACCEPTED), rate_sum(denominator)
    return f"(\n  {accepted}\nor\n  0 * {total}\n)\n/ {total}"


def share(numerator: str, denominator: str) -> str:
    """Each arm's part of its deployment's total."""
    return f"{numerator}\n/ on ({PER_MODEL}) group_left\n{denominator}"


def copy_label(expr: str, to: str, source: str, pattern: str = "(.+)") -> str:
    """`expr` with label `to` set from the part of label `source` that `pattern` captures."""
    return f'label_replace({expr}, "{to}", "$1", "{source}", "{pattern}")'


# Ray Serve's series of the arms' engine replicas (applications `arm-<arm>`).
SERVE_ARMS = f'namespace=~"$namespace", application=~"{ARM_APP_PREFIX}$arm"'


def serve_per_arm(expr: str) -> str:
    """Ray Serve series (`expr`) labelled with the arm their application serves."""
    return copy_label(expr, "arm", "application", f"{ARM_APP_PREFIX}(.+)")


def per_arm_engine(aggregation: str, engine_series: str) -> str:
    """vLLM series (`engine_series`, labelled `ReplicaId` and `model_name`) aggregated per arm:
    each series gets the arm of the Ray Serve replica it comes from, through Serve's own gauge
    for that replica (`application` = `arm-<arm>`, `replica` = vLLM's `ReplicaId`)."""
    engine = copy_label(copy_label(engine_series, "replica", "ReplicaId"), "model", "model_name")
    replicas = (
        f"max by (namespace, replica, application) ({SERVE_PROCESSING_QUERIES}{{{SERVE_ARMS}}})"
    )
    arm_of_replica = serve_per_arm(f"{replicas} * 0 + 1")
    return (
        f"{aggregation} by ({PER_ARM}) (\n  {engine}\n"
        f"  * on (namespace, replica) group_left (arm)\n  {arm_of_replica}\n)"
    )


def resolve(expr: str, rate_interval: str = "1m") -> str:
    """`expr` as Prometheus can evaluate it outside Grafana: variables replaced by
    `EVALUATION_VALUES`, `$__rate_interval` by `rate_interval`."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in EVALUATION_VALUES.items():
        expr = re.sub(rf"\${name}\b", lambda _, value=value: value, expr)
    return expr


# -- panels -----------------------------------------------------------------------------------

PanelBuilder = (
    timeseries.Panel | stat.Panel | bargauge.Panel | statetimeline.Panel  # the kinds used here
)


def query(
    expr: str, legend: str, ref_id: str, *, instant: bool = False
) -> prometheus_builders.Dataquery:
    target = (
        prometheus_builders.Dataquery()
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .editor_mode(prometheus.QueryEditorMode.CODE)
    )
    return target.instant() if instant else target.range()


def with_queries(
    panel: PanelBuilder,
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str,
    width: int,
    height: int = 8,
    instant: bool = False,
) -> PanelBuilder:
    """`queries` are (expression, legend) pairs."""
    panel.title(title).description(description).datasource(DATASOURCE)
    panel.unit(unit).span(width).height(height)
    for index, (expr, legend) in enumerate(queries):
        panel.with_target(query(expr, legend, chr(ord("A") + index), instant=instant))
    return panel


def graph(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str,
    width: int = 8,
    height: int = 8,
    bars: bool = False,
    min_value: float | None = 0,
    max_value: float | None = None,
) -> timeseries.Panel:
    panel = timeseries.Panel().legend(
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "lastNotNull"])
    )
    panel.tooltip(
        common_builders.VizTooltipOptions()
        .mode(common.TooltipDisplayMode.MULTI)
        .sort(common.SortOrder.DESCENDING)
    )
    if bars:
        panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
    else:
        panel.line_width(2).fill_opacity(0).show_points(common.VisibilityMode.NEVER)
    if min_value is not None:
        panel.min(min_value)
    if max_value is not None:
        panel.max(max_value)
    return with_queries(panel, title, description, queries, unit=unit, width=width, height=height)


def state_mappings(mapping: dict[str, tuple[str, str]]) -> list[ValueMap]:
    """Value -> (text, colour) mappings."""
    return [
        ValueMap(
            options={
                value: ValueMappingResult(text=text, color=colour, index=index)
                for index, (value, (text, colour)) in enumerate(mapping.items())
            }
        )
    ]


# Percentiles of each latency panel; the legend names the arm and the percentile.
PERCENTILES = (0.5, 0.95, 0.99)
TOKENS_PER_S = "suffix: tok/s"
PER_ARM_LEGEND = "{{arm}}"


def latency(title: str, what: str, buckets: str) -> timeseries.Panel:
    return graph(
        title,
        f"{what} per arm, p50 / p95 / p99 over the rate interval, from the router's histogram "
        "(bucket boundaries in service/specserve/metrics.py bound the precision).",
        [(quantile(q, buckets), f"{{{{arm}}}} p{round(q * 100)}") for q in PERCENTILES],
        unit="s",
    )


def speculation_panels() -> list[PanelBuilder]:
    position = (
        f"sum by ({PER_ARM}, position) (rate({SPEC_ACCEPTED_PER_POSITION}{{{ARMS}}}{WINDOW}))\n"
        f"/ on ({PER_ARM}) group_left\n{rate_sum(SPEC_DRAFTS)}"
    )
    by_position = (
        bargauge.Panel()
        .orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["mean"]).values(False))
        .min(0)
        .max(1)
    )
    return [
        graph(
            "Acceptance rate",
            "Accepted draft tokens / proposed draft tokens, per arm (vLLM's definition). "
            "Arms without speculation (no-spec) have no drafts and show no line.",
            [(accepted_per(SPEC_DRAFT_TOKENS), PER_ARM_LEGEND)],
            unit="percentunit",
            max_value=1,
        ),
        graph(
            "Mean acceptance length",
            "Tokens each target forward pass yields: 1 + accepted draft tokens / drafts (the 1 is "
            "the bonus token every verify step produces). 1 means every draft is rejected.",
            [(f"1 + {accepted_per(SPEC_DRAFTS)}", PER_ARM_LEGEND)],
            unit="suffix: tok/step",
            min_value=1,
        ),
        with_queries(
            by_position,
            "Acceptance by draft position",
            "Share of drafts whose token at each position (0 = first drafted token) was "
            "accepted, per arm, averaged over the time range. Where it drops, more "
            "num_speculative_tokens stop paying; positions that never accepted are absent.",
            [(position, "{{arm}} position {{position}}")],
            unit="percentunit",
            width=8,
        ),
    ]


def speed_panels() -> list[PanelBuilder]:
    arm_tpot = quantile(0.5, TPOT_BUCKETS)
    baseline = f'{DEPLOYMENT}, arm="{BASELINE_ARM}"'
    baseline_tpot = quantile(0.5, TPOT_BUCKETS, baseline, by=PER_MODEL)
    speedup = f"(1 / {arm_tpot})\n* on ({PER_MODEL}) group_left\n{baseline_tpot}"
    return [
        graph(
            "Per-user output speed (p50)",
            "Output tokens per second one streaming request sees: 1 / median time per output "
            "token, per arm. Speculative decoding pays off where this beats the baseline arm.",
            [(f"1 / {arm_tpot}", PER_ARM_LEGEND)],
            unit=TOKENS_PER_S,
            width=12,
        ),
        graph(
            f"Speedup over {BASELINE_ARM}",
            f"Median time per output token of the baseline arm `{BASELINE_ARM}` (no "
            "speculation) / that of each arm: 2 means users see tokens twice as fast as "
            f"without speculation. Empty while `{BASELINE_ARM}` serves no streaming requests.",
            [(speedup, PER_ARM_LEGEND)],
            unit="suffix:x",
            width=12,
        ),
        graph(
            "Requests per second",
            "Requests each arm served (every outcome), per second.",
            [(rate_sum(REQUESTS), PER_ARM_LEGEND)],
            unit="reqps",
            width=12,
        ),
        graph(
            "Output tokens per second",
            "Tokens each arm generated per second, all requests together (from the engine's "
            "usage in each response).",
            [(rate_sum(OUTPUT_TOKENS), PER_ARM_LEGEND)],
            unit=TOKENS_PER_S,
            width=12,
        ),
    ]


def latency_panels() -> list[PanelBuilder]:
    return [
        latency(
            "Time to first token",
            "From arrival at the router to the first streamed token (streaming requests)",
            TTFT_BUCKETS,
        ),
        latency(
            "Time per output token",
            "Mean gap between output tokens after the first (one observation per streaming "
            "request)",
            TPOT_BUCKETS,
        ),
        latency(
            "End-to-end latency",
            "From arrival at the router to the last byte (successful requests)",
            E2E_BUCKETS,
        ),
    ]


def traffic_panels() -> list[PanelBuilder]:
    configured = share(
        gauge_max(ARM_WEIGHT),
        f"sum by ({PER_MODEL}) ({gauge_max(ARM_WEIGHT, DEPLOYMENT)})",
    )
    observed = share(
        rate_sum(ARM_SELECTIONS, f"{ARMS}, {BY_WEIGHT}"),
        rate_sum(ARM_SELECTIONS, f"{DEPLOYMENT}, {BY_WEIGHT}", by=PER_MODEL),
    )
    dashed = DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})
    failed = (
        f"sum by ({PER_ARM}, outcome) "
        f'(rate({REQUESTS}{{{ARMS}, outcome!="{metrics.OUTCOME_OK}"}}{WINDOW}))\n'
        f"/ on ({PER_ARM}) group_left\n{rate_sum(REQUESTS)}"
    )
    running = (
        statetimeline.Panel()
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(80)
        .mappings(state_mappings({"1": ("running", "green"), "0": ("not running", "red")}))
    )
    return [
        graph(
            "Traffic share: configured vs observed",
            "Dashed: each arm's configured share, weight / sum of weights. Solid: its observed "
            "share of the requests routed by weight or sticky key (overrides by header are "
            "left out). They differ while an arm is not running (its traffic falls back to the "
            "others) and, for sticky keys, while there are few distinct keys.",
            [(configured, "{{arm}} configured"), (observed, "{{arm}} observed")],
            unit="percentunit",
            width=12,
            max_value=1,
        ).override_by_regexp(".* configured$", [dashed]),
        graph(
            "Error rate by outcome",
            "Share of each arm's requests that did not end ok: client_error (4xx, a bad "
            "request), server_error (5xx, the arm or the router failed), cancelled (the client "
            "went away).",
            [(failed, "{{arm}} {{outcome}}")],
            unit="percentunit",
            width=12,
        ),
        with_queries(
            running,
            "Arm running state",
            "Whether each arm's engine application is RUNNING, as the router sees it. An arm "
            "that is not running gets no traffic by weight or sticky key (see Routing "
            "fallbacks).",
            [(gauge_max(ARM_RUNNING), PER_ARM_LEGEND)],
            unit="none",
            width=12,
        ),
        graph(
            "Routing fallbacks",
            "Requests per second the weights or a sticky key sent to this arm while it was not "
            "running, served by a running arm instead.",
            [(rate_sum(ROUTING_FALLBACKS), PER_ARM_LEGEND)],
            unit="reqps",
            width=12,
        ),
    ]


def config_panels() -> list[PanelBuilder]:
    last = common_builders.ReduceDataOptions().calcs(["lastNotNull"])
    revision = (
        stat.Panel()
        .text_mode(common.BigValueTextMode.NAME)
        .color_mode(common.BigValueColorMode.NONE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(last)
    )
    newest = (
        stat.Panel()
        .text_mode(common.BigValueTextMode.VALUE)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(last)
        .mappings(state_mappings({"1": ("applied", "green"), "0": ("rejected", "red")}))
    )
    reloads = f"max by ({PER_MODEL}, result) (increase({CONFIG_RELOADS}{{{DEPLOYMENT}}}{WINDOW}))"
    return [
        with_queries(
            revision,
            "Config revision",
            "The active config revision (a hash of the config file) per deployment. Changes "
            "show as annotations on every graph.",
            [(gauge_max(CONFIG_INFO, DEPLOYMENT, f"{PER_MODEL}, revision"), "{{revision}}")],
            unit="none",
            width=6,
            height=5,
            instant=True,
        ),
        with_queries(
            newest,
            "Newest config file",
            "Whether the newest config file the router read was valid and applied. Rejected: "
            "the last good config keeps serving and the router log names the reason.",
            [(gauge_max(CONFIG_LAST_RELOAD_SUCCESS, DEPLOYMENT, PER_MODEL), "{{model}}")],
            unit="none",
            width=6,
            height=5,
            instant=True,
        ),
        graph(
            "Config reloads",
            "New config revisions the router saw, by result (applied or invalid). Every router "
            "replica reads the file itself: this is the most any one replica counted.",
            [(reloads, "{{result}}")],
            unit="short",
            width=12,
            height=5,
            bars=True,
        ),
    ]


def engine_panels() -> list[PanelBuilder]:
    def engine(name: str) -> str:
        return f"{name}{{{ENGINES}}}"

    return [
        graph(
            "Running requests",
            "Requests in the engines' running batch, summed over each arm's replicas (vLLM's "
            "num_requests_running). vLLM exports it only while the engine is busy.",
            [(per_arm_engine("sum", engine(VLLM_RUNNING)), PER_ARM_LEGEND)],
            unit="short",
        ),
        graph(
            "Waiting requests",
            "Requests queued in the engines, waiting for room in the batch, summed over each "
            "arm's replicas. Steadily above 0: the arm is saturated.",
            [(per_arm_engine("sum", engine(VLLM_WAITING)), PER_ARM_LEGEND)],
            unit="short",
        ),
        graph(
            "KV-cache usage",
            "Share of the KV cache in use on the fullest replica of each arm. Near 100%, new "
            "requests wait (see Waiting requests).",
            [(per_arm_engine("max", engine(VLLM_KV_CACHE_USAGE)), PER_ARM_LEGEND)],
            unit="percentunit",
            max_value=1,
        ),
    ]


def load_panels() -> list[PanelBuilder]:
    generated = f"rate({VLLM_GENERATION_TOKENS}{{{ENGINES}}}{WINDOW})"
    processing = f"{SERVE_PROCESSING_QUERIES}{{{SERVE_ARMS}}}"
    replicas = f"max by (namespace, application, replica) ({processing})"
    return [
        graph(
            "Generated tokens per second (engine)",
            "Tokens each arm's engines generated per second, as vLLM counts them; compare with "
            "the router's count on the arms dashboard.",
            [(per_arm_engine("sum", generated), PER_ARM_LEGEND)],
            unit=TOKENS_PER_S,
        ),
        graph(
            "Queries in flight per arm",
            "Queries each arm's Serve replicas are processing, summed over its replicas (Ray "
            "Serve's replica_processing_queries).",
            [(f"sum by (namespace, arm) ({serve_per_arm(processing)})", PER_ARM_LEGEND)],
            unit="short",
        ),
        graph(
            "Engine replicas per arm",
            "Serve replicas reporting for each arm's engine application.",
            [(f"count by (namespace, arm) ({serve_per_arm(replicas)})", PER_ARM_LEGEND)],
            unit="short",
        ),
    ]


# -- dashboards -------------------------------------------------------------------------------


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
