"""The PromQL the dashboards are written in: the names of the series they read and the
selectors, aggregations and joins their queries are built from.

The router's series are named from service/specserve/metrics.py as Ray exports them; Ray Serve's
and vLLM's own series are listed in `ENGINE_METRICS`, the only other names a query may use. Each
router replica exports its own series and Kubernetes adds pod labels, so the helpers aggregate:
counters summed (`rate_sum`), gauges maxed (`gauge_max`), histograms summed by `le` (`quantile`),
by (namespace, model, arm). vLLM's series carry no arm label: `per_arm_engine` joins them to their
arm through Ray Serve's replica series. Selectors use only the template variables in `VARIABLES`
(always as `=~"$var"` matchers) and `$__rate_interval`; `resolve` replaces them to evaluate a
query outside Grafana.
"""

from __future__ import annotations

import re

from specserve import metrics
from specserve.config.serve_config import ARM_APP_PREFIX

# -- series -----------------------------------------------------------------------------------

# The template variables queries may use, always as `label=~"$name"`.
VARIABLES = ("namespace", "model", "arm")
# What `resolve` puts in their place to evaluate a query outside Grafana.
EVALUATION_VALUES = {"namespace": ".*", "model": ".*", "arm": ".*"}


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
STAT_COUNT = _series(metrics.REQUEST_STAT_COUNT, "_total")
STAT_SUM = _series(metrics.REQUEST_STAT_SUM, "_total")
TTFT_BUCKETS = _series(metrics.TIME_TO_FIRST_TOKEN, "_bucket")
TPOT_BUCKETS = _series(metrics.TIME_PER_OUTPUT_TOKEN, "_bucket")
E2E_BUCKETS = _series(metrics.E2E_LATENCY, "_bucket")
ARM_WEIGHT = _series(metrics.ARM_WEIGHT)
ARM_SPECULATIVE_TOKENS = _series(metrics.ARM_SPECULATIVE_TOKENS)
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

# -- selectors and aggregations ---------------------------------------------------------------

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
