"""Every metric specserve exports, declared once.

Labels come only from small known sets: arm names from the config, fixed outcome and result
words, draft positions below the configured k. Derived figures (PromQL, per arm):

  acceptance rate          = rate(specserve_spec_accepted_tokens_total[5m])
                             / rate(specserve_spec_draft_tokens_total[5m])
  mean acceptance length   = 1 + rate(specserve_spec_accepted_tokens_total[5m])
                                 / rate(specserve_spec_drafts_total[5m])
  acceptance at position p = rate(specserve_spec_accepted_tokens_per_position_total{
                                 position="p"}[5m])
                             / rate(specserve_spec_drafts_total[5m])

These are vLLM's definitions (v1/spec_decode/metrics.py). docs/metrics.md has the full list.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# `*_created` samples double the exposition for no use in dashboards.
disable_created_metrics()

PREFIX = "specserve"
ARM = "arm"
OUTCOME = "outcome"
ENDPOINT = "endpoint"
POSITION = "position"
RESULT = "result"
REVISION = "revision"

# Request outcomes (label values of specserve_requests_total).
OUTCOME_OK = "ok"
OUTCOME_CLIENT_ERROR = "client_error"  # 4xx: the request was bad
OUTCOME_SERVER_ERROR = "server_error"  # 5xx: the arm or the router failed
OUTCOME_CANCELLED = "cancelled"  # the client went away mid-request
# Config reload results (label values of specserve_config_reloads_total).
RELOAD_APPLIED = "applied"
RELOAD_INVALID = "invalid"

# Seconds. CPU engines answer in 10 ms - 1 min; GPU ones at the low end of the same range.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08),
    *(0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
)


class RouterMetrics:
    """The router's metrics in a registry of their own (served on the metrics port)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by arm, endpoint and outcome.",
            (ARM, ENDPOINT, OUTCOME),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From request arrival at the router to the first output token.",
            (ARM,),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per output token after the first, one observation per request.",
            (ARM,),
            buckets=TOKEN_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From request arrival at the router to the last byte of the response.",
            (ARM,),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.output_tokens = Counter(
            f"{PREFIX}_output_tokens", "Generated tokens.", (ARM,), registry=r
        )
        self.drafts = Counter(
            f"{PREFIX}_spec_drafts",
            "Speculative verify steps (drafts proposed).",
            (ARM,),
            registry=r,
        )
        self.draft_tokens = Counter(
            f"{PREFIX}_spec_draft_tokens", "Draft tokens proposed.", (ARM,), registry=r
        )
        self.accepted_tokens = Counter(
            f"{PREFIX}_spec_accepted_tokens", "Draft tokens accepted.", (ARM,), registry=r
        )
        self.accepted_per_position = Counter(
            f"{PREFIX}_spec_accepted_tokens_per_position",
            "Draft tokens accepted at each draft position (0 = first drafted token).",
            (ARM, POSITION),
            registry=r,
        )
        self.arm_weight = Gauge(
            f"{PREFIX}_arm_weight",
            "Configured traffic weight of each arm in the active config.",
            (ARM,),
            registry=r,
        )
        self.config_info = Gauge(
            f"{PREFIX}_config_info",
            "1 for the revision of the active config (content hash of the file).",
            (REVISION,),
            registry=r,
        )
        self.config_reloads = Counter(
            f"{PREFIX}_config_reloads",
            "New config revisions seen, by result (applied or invalid).",
            (RESULT,),
            registry=r,
        )
        self.config_last_reload_success = Gauge(
            f"{PREFIX}_config_last_reload_successful",
            "1 if the newest config file seen was valid and applied, 0 if it was rejected.",
            registry=r,
        )

    def set_active_config(self, revision: str, weights: dict[str, float]) -> None:
        self.config_info.clear()
        self.config_info.labels(revision).set(1)
        self.arm_weight.clear()
        for arm, weight in weights.items():
            self.arm_weight.labels(arm).set(weight)

    def observe_spec_decode(self, arm: str, stats: dict) -> None:
        """Count one request's speculative-decoding stats (vLLM's per-request summary).

        `acceptance_histogram[j]` counts verify steps that accepted exactly j draft tokens, and
        acceptance is a prefix, so position p was accepted in every step with j > p.
        """
        histogram = stats.get("acceptance_histogram") or []
        self.drafts.labels(arm).inc(stats.get("num_spec_steps", 0))
        self.draft_tokens.labels(arm).inc(stats.get("num_draft_tokens", 0))
        self.accepted_tokens.labels(arm).inc(stats.get("num_accepted_draft_tokens", 0))
        for position in range(max(len(histogram) - 1, 0)):
            self.accepted_per_position.labels(arm, str(position)).inc(
                sum(histogram[position + 1 :])
            )
