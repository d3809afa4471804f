"""The panels of the Grafana dashboards (grafana-foundation-sdk builders), one function per row.

Every panel reads the Prometheus the `datasource` variable names and queries it in the vocabulary
of grafana/promql.py; grafana/dashboards.py lays the rows out into dashboards.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.models import common, prometheus
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DynamicConfigValue,
    ValueMap,
    ValueMappingResult,
)

from grafana.promql import (
    ARM_RUNNING,
    ARM_SELECTIONS,
    ARM_SPECULATIVE_TOKENS,
    ARM_WEIGHT,
    ARMS,
    BY_WEIGHT,
    CONFIG_INFO,
    CONFIG_LAST_RELOAD_SUCCESS,
    CONFIG_RELOADS,
    DEPLOYMENT,
    E2E_BUCKETS,
    ENGINES,
    OUTPUT_TOKENS,
    PER_ARM,
    PER_MODEL,
    REQUESTS,
    ROUTING_FALLBACKS,
    SERVE_ARMS,
    SERVE_PROCESSING_QUERIES,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    STAT_COUNT,
    STAT_SUM,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    VLLM_GENERATION_TOKENS,
    VLLM_KV_CACHE_USAGE,
    VLLM_RUNNING,
    VLLM_WAITING,
    WINDOW,
    accepted_per,
    gauge_max,
    per_arm_engine,
    quantile,
    rate_sum,
    serve_per_arm,
    share,
)
from specserve import metrics

# Every panel reads the Prometheus the `datasource` variable names: the files load in any Grafana.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# The arm the speedup panel divides by: the configs name their arm without speculation so.
BASELINE_ARM = "no-spec"

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
        graph(
            "k in force (configured)",
            "Draft tokens per step (num_speculative_tokens) each arm's config gives it, per "
            "range of batch sizes (requests in one engine step): a k schedule (`specserve "
            "tune`) has one line per range, a fixed k one line `1+`, no speculation 0.",
            [
                (
                    gauge_max(ARM_SPECULATIVE_TOKENS, by=f"{PER_ARM}, {metrics.BATCH_SIZES}"),
                    "{{arm}} batch {{batch_sizes}}",
                )
            ],
            unit="suffix: tokens",
            width=12,
        ),
        graph(
            "k in force (drafted)",
            "Draft tokens proposed per draft, per arm: the k the engines actually used, "
            "averaged over the rate interval. Under a k schedule it falls as load grows; steps "
            "at k = 0 propose no draft and do not count.",
            [(f"{rate_sum(SPEC_DRAFT_TOKENS)}\n/ {rate_sum(SPEC_DRAFTS)}", PER_ARM_LEGEND)],
            unit="suffix: tokens",
            width=12,
        ),
    ]


def speed_panels() -> list[PanelBuilder]:
    arm_tpot = quantile(0.5, TPOT_BUCKETS)
    baseline = f'{DEPLOYMENT}, arm="{BASELINE_ARM}"'
    baseline_tpot = quantile(0.5, TPOT_BUCKETS, baseline, by=PER_MODEL)
    speedup = f"(1 / {arm_tpot})\n* on ({PER_MODEL}) group_left\n{baseline_tpot}"
    speed_stat = f'{ARMS}, stat="{metrics.REQUEST_OUTPUT_SPEED}"'
    mean_speed = f"{rate_sum(STAT_SUM, speed_stat)}\n/ {rate_sum(STAT_COUNT, speed_stat)}"
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
            "Per-user output speed (mean, every request)",
            "Output tokens / (arrival to last byte) of each successful request, streaming or "
            "not, averaged per arm: what `specserve ab report` compares (from the exact sums, "
            "not the histogram's bucket midpoints).",
            [(mean_speed, PER_ARM_LEGEND)],
            unit=TOKENS_PER_S,
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
            "New config revisions the router saw, by result (applied or invalid). The router in "
            "every pod's HTTP proxy reads the file itself: this is the most any one counted.",
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
