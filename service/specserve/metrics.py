"""Every metric specserve exports, declared once.

The router (the dispatch in each Ray Serve HTTP proxy, router/dispatch.py) records through Ray's
metrics API (`ray.util.metrics`): each Ray node's metrics agent exports what every process on that
node recorded on one port (Ray's metrics export port, 8080 in the Helm chart,
`SPECSERVE_METRICS_PORT` locally), next to vLLM's engine metrics and Ray Serve's own. Each node's
proxy is its own series (Ray adds `WorkerId`); sum counters and take the max of gauges across
them. Ray prefixes every exported name with `ray_`, so `specserve_requests` is scraped as
`ray_specserve_requests_total`. Ray's exporter drops a gauge series two export intervals after its
last update, so the router sets its gauges again every second (`refresh_gauges`); a removed arm's
or an old revision's series then ages out like a cleared label set.

Labels come only from small known sets: the model and arm names from the config, fixed outcome,
selection and result words, draft positions below the configured k. Derived figures (PromQL,
per arm; docs/metrics.md has them all):

  acceptance rate          = rate(ray_specserve_spec_accepted_tokens_total[5m])
                             / rate(ray_specserve_spec_draft_tokens_total[5m])
  mean acceptance length   = 1 + rate(ray_specserve_spec_accepted_tokens_total[5m])
                                 / rate(ray_specserve_spec_drafts_total[5m])
  acceptance at position p = rate(ray_specserve_spec_accepted_tokens_per_position_total{
                                 position="p"}[5m])
                             / rate(ray_specserve_spec_drafts_total[5m])
  accepted once drafted, p = rate(ray_specserve_spec_accepted_tokens_per_position_total{
                                 position="p"}[5m])
                             / rate(ray_specserve_spec_draft_tokens_per_position_total{
                                 position="p"}[5m])
  k in force (drafted)     = rate(ray_specserve_spec_draft_tokens_total[5m])
                             / rate(ray_specserve_spec_drafts_total[5m])

The first three are vLLM's definitions (v1/spec_decode/metrics.py). Under a k schedule
(k by batch size) not every draft reaches position p, so the k advisor and `specserve tune`
read the fourth: the chance a token at p is accepted once it was drafted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from ray.util.metrics import Counter, Gauge, Histogram

# Ray's exporter puts this in front of every name recorded through ray.util.metrics.
EXPORT_PREFIX = "ray_"
PREFIX = "specserve"

MODEL = "model"
ARM = "arm"
OUTCOME = "outcome"
ENDPOINT = "endpoint"
POSITION = "position"
RESULT = "result"
REVISION = "revision"
SELECTED_BY = "selected_by"
STAT = "stat"
BATCH_SIZES = "batch_sizes"  # a k schedule's range of batch sizes, as the config writes it
KEY = "key"  # an API key's name (never the key)
KEYS_FILE = "keys"  # which keys file: api or admin
# Which of UNIT_BUCKETS groups a request's randomisation unit hashes to (router/selection.py).
UNIT_BUCKET = "unit_bucket"
UNIT_BUCKETS = 32

# Request outcomes (label values of specserve_requests_total).
OUTCOME_OK = "ok"
OUTCOME_CLIENT_ERROR = "client_error"  # 4xx: the request was bad
OUTCOME_SERVER_ERROR = "server_error"  # 5xx: the arm or the router failed
OUTCOME_CANCELLED = "cancelled"  # the client went away mid-request
OUTCOME_REJECTED = "rejected"  # 429/503: the arm was at capacity or not running; retry later
# The arm label of requests refused before an arm was chosen (no arm name can start with "-").
NO_ARM = "-"
# How the arm of a request was chosen (label values of specserve_arm_selections_total).
SELECTED_BY_OVERRIDE = "override"  # the override header named it
SELECTED_BY_STICKY = "sticky"  # a sticky key hashed onto the weights of running arms
SELECTED_BY_WEIGHT = "weight"  # random by the weights of running arms
# Among the only arms that can serve the request: vLLM's speculative decoding refuses some
# sampling parameters (wire/requests.py `needs_plain_decoding`). Not randomized.
SELECTED_BY_CAPABILITY = "capability"
# Authentication results (label values of specserve_api_key_requests_total).
AUTH_ACCEPTED = "accepted"
AUTH_MISSING = "missing"  # no key sent: 401
AUTH_INVALID = "invalid"  # a key that is not configured: 401
AUTH_FORBIDDEN = "forbidden"  # a public key asked for an admin power: 403
AUTH_RATE_LIMITED = "rate_limited"  # past the key's per-minute limits: 429
# The key label of requests with no valid key (no key name can be empty).
NO_KEY = "-"
# Config reload results (label values of specserve_config_reloads_total).
RELOAD_APPLIED = "applied"
RELOAD_INVALID = "invalid"

# Seconds. CPU engines answer in 10 ms - 1 min; GPU ones at the low end of the same range.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08),
    *(0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
)
# Output tokens per second of one request (per user): CPU engines 5-100, GPU ones up to ~1,000.
OUTPUT_SPEED_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
ACCEPTANCE_LENGTH_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)

REQUESTS = f"{PREFIX}_requests"
ARM_SELECTIONS = f"{PREFIX}_arm_selections"
ROUTING_FALLBACKS = f"{PREFIX}_routing_fallbacks"
TIME_TO_FIRST_TOKEN = f"{PREFIX}_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = f"{PREFIX}_time_per_output_token_seconds"
E2E_LATENCY = f"{PREFIX}_e2e_request_latency_seconds"
REQUEST_OUTPUT_SPEED = f"{PREFIX}_request_output_tokens_per_second"
REQUEST_ACCEPTANCE_LENGTH = f"{PREFIX}_request_acceptance_length"
# Count, exact sum and sum of squares of the observations of each per-request histogram the A/B
# report compares (label `stat`: the histogram's name), over weighted and sticky requests only
# (forced ones are not randomized): each arm's exact mean and variance. (Ray exports a
# histogram's _sum from bucket midpoints, not the values.)
REQUEST_STAT_COUNT = f"{PREFIX}_request_stat_count"
REQUEST_STAT_SUM = f"{PREFIX}_request_stat_sum"
REQUEST_STAT_SQUARES = f"{PREFIX}_request_stat_squares"
AB_STATS = (TIME_PER_OUTPUT_TOKEN, REQUEST_OUTPUT_SPEED, REQUEST_ACCEPTANCE_LENGTH)
# The same requests' count and sum by the bucket of their randomisation unit (the sticky key, or
# the request itself without one), and the randomized selections by bucket: a user's requests all
# fall in one bucket, so the buckets are independent groups and the A/B report's intervals and
# sample-ratio check hold however many requests one user sends (cluster-robust, ab/report.py).
UNIT_STAT_COUNT = f"{PREFIX}_unit_stat_count"
UNIT_STAT_SUM = f"{PREFIX}_unit_stat_sum"
UNIT_SELECTIONS = f"{PREFIX}_unit_selections"
# Weighted and sticky requests left out of the A/B statistics: their prompt is one the config
# names (routing.ab_left_out_prompts, what a challenger was trained on).
AB_LEFT_OUT = f"{PREFIX}_ab_left_out_requests"
OUTPUT_TOKENS = f"{PREFIX}_output_tokens"
SPEC_DRAFTS = f"{PREFIX}_spec_drafts"
SPEC_DRAFT_TOKENS = f"{PREFIX}_spec_draft_tokens"
SPEC_ACCEPTED_TOKENS = f"{PREFIX}_spec_accepted_tokens"
SPEC_ACCEPTED_PER_POSITION = f"{PREFIX}_spec_accepted_tokens_per_position"
SPEC_DRAFTED_PER_POSITION = f"{PREFIX}_spec_draft_tokens_per_position"
ARM_SPECULATIVE_TOKENS = f"{PREFIX}_arm_speculative_tokens"
ARM_WEIGHT = f"{PREFIX}_arm_weight"
ARM_RUNNING = f"{PREFIX}_arm_running"
ARM_DRAINED = f"{PREFIX}_arm_drained"
GUARDRAIL_DRAINS = f"{PREFIX}_guardrail_drains"
ENGINE_RETRIES = f"{PREFIX}_engine_retries"
STREAMS_RESUMED = f"{PREFIX}_streams_resumed"
REQUESTS_IN_FLIGHT = f"{PREFIX}_requests_in_flight"
CONFIG_INFO = f"{PREFIX}_config_info"
CONFIG_RELOADS = f"{PREFIX}_config_reloads"
CONFIG_LAST_RELOAD_SUCCESS = f"{PREFIX}_config_last_reload_successful"
API_KEY_REQUESTS = f"{PREFIX}_api_key_requests"
API_KEY_OUTPUT_TOKENS = f"{PREFIX}_api_key_output_tokens"
ARM_STATES_AGE = f"{PREFIX}_arm_states_age_seconds"
KEYS_FILE_REFUSED = f"{PREFIX}_keys_file_refused"
# Recorded by the arms' engine replicas (capture/), not the router.
CAPTURED_RECORDS = f"{PREFIX}_captured_records"
CAPTURE_DROPPED = f"{PREFIX}_capture_dropped_records"

COUNTERS = (
    REQUESTS,
    ARM_SELECTIONS,
    ROUTING_FALLBACKS,
    OUTPUT_TOKENS,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_DRAFTED_PER_POSITION,
    CONFIG_RELOADS,
    GUARDRAIL_DRAINS,
    ENGINE_RETRIES,
    STREAMS_RESUMED,
    REQUEST_STAT_COUNT,
    REQUEST_STAT_SUM,
    REQUEST_STAT_SQUARES,
    UNIT_STAT_COUNT,
    UNIT_STAT_SUM,
    UNIT_SELECTIONS,
    AB_LEFT_OUT,
    API_KEY_REQUESTS,
    API_KEY_OUTPUT_TOKENS,
    CAPTURED_RECORDS,
    CAPTURE_DROPPED,
)
HISTOGRAMS = (
    TIME_TO_FIRST_TOKEN,
    TIME_PER_OUTPUT_TOKEN,
    E2E_LATENCY,
    REQUEST_OUTPUT_SPEED,
    REQUEST_ACCEPTANCE_LENGTH,
)
GAUGES = (
    ARM_WEIGHT,
    ARM_SPECULATIVE_TOKENS,
    ARM_RUNNING,
    ARM_DRAINED,
    REQUESTS_IN_FLIGHT,
    CONFIG_INFO,
    CONFIG_LAST_RELOAD_SUCCESS,
    ARM_STATES_AGE,
    KEYS_FILE_REFUSED,
)


def exported_names() -> set[str]:
    """Every series name a scrape shows (what dashboards and alert rules may use)."""
    names = {EXPORT_PREFIX + name + "_total" for name in COUNTERS}
    names |= {
        EXPORT_PREFIX + name + s for name in HISTOGRAMS for s in ("_bucket", "_sum", "_count")
    }
    return names | {EXPORT_PREFIX + name for name in GAUGES}


def accepted_per_position(histogram: list[int]) -> list[int]:
    """Accepted draft tokens at each position from vLLM's per-request `acceptance_histogram`.

    `histogram[j]` counts verify steps that accepted exactly j draft tokens, and acceptance is a
    prefix, so position p was accepted in every step with j > p.
    """
    return [sum(histogram[p + 1 :]) for p in range(max(len(histogram) - 1, 0))]


def drafted_per_position(stats: dict) -> list[int]:
    """Draft tokens proposed at each position from vLLM's per-request stats: exact from the
    per-step draft lengths (`detailed`, what arms with a k schedule report); else every verify
    step's draft taken as the request's mean length (`summary`: exact for a fixed k)."""
    per_step = stats.get("per_step_drafted")
    if per_step:
        longest = max(per_step)
        return [sum(1 for n in per_step if n > p) for p in range(longest)]
    steps = int(stats.get("num_spec_steps") or 0)
    if not steps:
        return []
    return [steps] * round(int(stats.get("num_draft_tokens") or 0) / steps)


class RouterMetrics:
    """The router's metrics; `model` labels every series (one target model per config)."""

    def __init__(self, model: str) -> None:
        self.model = model
        arm = (MODEL, ARM)
        self.requests = Counter(
            REQUESTS, "Requests by arm, endpoint and outcome.", (*arm, ENDPOINT, OUTCOME)
        )
        self.arm_selections = Counter(
            ARM_SELECTIONS,
            "Requests routed to each arm, by how the arm was chosen (override, sticky, weight).",
            (*arm, SELECTED_BY),
        )
        self.routing_fallbacks = Counter(
            ROUTING_FALLBACKS,
            "Requests the weights or a sticky key sent to this arm while it was not running, "
            "routed to a running arm instead.",
            arm,
        )
        self.time_to_first_token = Histogram(
            TIME_TO_FIRST_TOKEN,
            "From request arrival at the router to the first output token (streaming).",
            list(LATENCY_BUCKETS_S),
            arm,
        )
        self.time_per_output_token = Histogram(
            TIME_PER_OUTPUT_TOKEN,
            "Mean time per output token after the first, one observation per streaming request.",
            list(TOKEN_LATENCY_BUCKETS_S),
            arm,
        )
        self.e2e_latency = Histogram(
            E2E_LATENCY,
            "From request arrival at the router to the last byte of the response.",
            list(LATENCY_BUCKETS_S),
            arm,
        )
        self.output_speed = Histogram(
            REQUEST_OUTPUT_SPEED,
            "Output tokens per second of one request, arrival to last byte (per-user speed).",
            list(OUTPUT_SPEED_BUCKETS),
            arm,
        )
        self.acceptance_length = Histogram(
            REQUEST_ACCEPTANCE_LENGTH,
            "Mean acceptance length of one speculative request (1 + accepted / verify steps).",
            list(ACCEPTANCE_LENGTH_BUCKETS),
            arm,
        )
        # Per key too: the A/B report reads each key's segment beside the whole arm.
        self.stat_count = Counter(
            REQUEST_STAT_COUNT,
            "Weighted and sticky requests observed by the per-request histogram named by `stat`, "
            "by the sending key's name.",
            (*arm, STAT, KEY),
        )
        self.stat_sum = Counter(
            REQUEST_STAT_SUM,
            "Exact sum of the observations of the per-request histogram named by `stat`, by key.",
            (*arm, STAT, KEY),
        )
        self.stat_squares = Counter(
            REQUEST_STAT_SQUARES,
            "Sum of the squared observations of the per-request histogram named by `stat`, by key.",
            (*arm, STAT, KEY),
        )
        self.unit_stat_count = Counter(
            UNIT_STAT_COUNT,
            "Weighted and sticky requests observed by the per-request histogram named by `stat`, "
            "by the bucket of their randomisation unit.",
            (*arm, STAT, UNIT_BUCKET),
        )
        self.unit_stat_sum = Counter(
            UNIT_STAT_SUM,
            "Exact sum of the observations of the per-request histogram named by `stat`, by the "
            "bucket of their randomisation unit.",
            (*arm, STAT, UNIT_BUCKET),
        )
        self.unit_selections = Counter(
            UNIT_SELECTIONS,
            "Requests the weights or a sticky key sent to each arm, by the bucket of their "
            "randomisation unit.",
            (*arm, UNIT_BUCKET),
        )
        self.ab_left_out = Counter(
            AB_LEFT_OUT,
            "Successful weighted and sticky requests left out of the A/B statistics: their "
            "prompt is one the config names (a challenger's training prompts).",
            arm,
        )
        self.output_tokens = Counter(OUTPUT_TOKENS, "Generated tokens.", arm)
        self.drafts = Counter(SPEC_DRAFTS, "Speculative verify steps (drafts proposed).", arm)
        self.draft_tokens = Counter(SPEC_DRAFT_TOKENS, "Draft tokens proposed.", arm)
        self.accepted_tokens = Counter(SPEC_ACCEPTED_TOKENS, "Draft tokens accepted.", arm)
        self.accepted_per_position = Counter(
            SPEC_ACCEPTED_PER_POSITION,
            "Draft tokens accepted at each draft position (0 = first drafted token).",
            (*arm, POSITION),
        )
        self.drafted_per_position = Counter(
            SPEC_DRAFTED_PER_POSITION,
            "Draft tokens proposed at each draft position (0 = first drafted token): under a "
            "k schedule, the drafts that reached the position.",
            (*arm, POSITION),
        )
        self.arm_weight = Gauge(
            ARM_WEIGHT, "Configured traffic weight of each arm in the active config.", arm
        )
        self.arm_speculative_tokens = Gauge(
            ARM_SPECULATIVE_TOKENS,
            "Draft tokens per step (k) the active config gives each arm, per range of batch "
            "sizes (`1+`: every batch size; 0 for an arm without speculation).",
            (*arm, BATCH_SIZES),
        )
        self.arm_running = Gauge(
            ARM_RUNNING,
            "1 while the arm takes traffic (its engine application RUNNING, or redeploying while "
            "its old replicas serve), else 0.",
            arm,
        )
        self.arm_drained = Gauge(
            ARM_DRAINED,
            "1 while the acceptance guardrail keeps weighted and sticky traffic off the arm.",
            arm,
        )
        self.guardrail_drains = Counter(
            GUARDRAIL_DRAINS,
            "Times the acceptance guardrail drained the arm (mean acceptance below the floor).",
            arm,
        )
        self.engine_retries = Counter(
            ENGINE_RETRIES,
            "Requests replayed once because the arm's engine replica failed before sending "
            "anything.",
            arm,
        )
        self.streams_resumed = Counter(
            STREAMS_RESUMED,
            "Streams resumed from where they stood because the arm's engine replica failed "
            "mid-stream.",
            arm,
        )
        self.requests_in_flight = Gauge(
            REQUESTS_IN_FLIGHT,
            "Requests the router (the dispatch in one HTTP proxy) has started and not finished, "
            "streams included.",
            (MODEL,),
        )
        self.config_info = Gauge(
            CONFIG_INFO,
            "1 for the revision of the active config (content hash of the file).",
            (MODEL, REVISION),
        )
        self.config_reloads = Counter(
            CONFIG_RELOADS,
            "New config revisions seen, by result (applied or invalid).",
            (MODEL, RESULT),
        )
        self.config_last_reload_success = Gauge(
            CONFIG_LAST_RELOAD_SUCCESS,
            "1 if the newest config file seen was valid and applied, 0 if it was rejected.",
            (MODEL,),
        )
        self.api_key_requests = Counter(
            API_KEY_REQUESTS,
            "Inference requests by API key name and authentication result (accepted, missing, "
            "invalid, forbidden, rate_limited); key `-` when no valid key was sent.",
            (MODEL, KEY, RESULT),
        )
        self.api_key_output_tokens = Counter(
            API_KEY_OUTPUT_TOKENS, "Generated tokens by API key name.", (MODEL, KEY)
        )
        self.keys_file_refused = Gauge(
            KEYS_FILE_REFUSED,
            "1 while the newest version of a keys file (keys: api or admin) is refused: it "
            "gives no new key, and the keys it no longer holds are dropped.",
            (MODEL, KEYS_FILE),
        )
        self.arm_states_age = Gauge(
            ARM_STATES_AGE,
            "Seconds since this router last read which arms run from the Ray Serve "
            "controller (about 1 normally; growing while the controller does not answer).",
            (MODEL,),
        )
        # The gauges' current values, set again by every refresh.
        self._revision = ""
        self._weights: dict[str, float] = {}
        self._k: dict[str, list[tuple[str, int]]] = {}
        self._running: dict[str, bool] = {}
        self._drained: frozenset[str] = frozenset()
        self._in_flight = 0
        self._last_reload_ok = True
        self._arm_states_age_s = 0.0
        self._keys_refused: dict[str, bool] = {}

    def _tags(self, arm: str, **more: str) -> dict[str, str]:
        return {MODEL: self.model, ARM: arm, **more}

    # -- gauges -----------------------------------------------------------------------------

    def set_active_config(
        self,
        revision: str,
        weights: Mapping[str, float],
        k: Mapping[str, list[tuple[str, int]]] | None = None,
    ) -> None:
        """The active revision, each arm's weight and its k per range of batch sizes."""
        self._revision, self._weights, self._k = revision, dict(weights), dict(k or {})
        self._running = {arm: self._running.get(arm, False) for arm in weights}
        self.refresh_gauges()

    def set_running(self, running: Mapping[str, bool]) -> None:
        self._running = dict(running)
        self.refresh_gauges()

    def set_drained(self, drained: frozenset[str]) -> None:
        self._drained = drained

    def count_drain(self, arm: str) -> None:
        self.guardrail_drains.inc(1, self._tags(arm))
        self.set_drained(self._drained | {arm})
        self.refresh_gauges()

    def set_in_flight(self, count: int) -> None:
        self._in_flight = count

    def set_arm_states_age(self, seconds: float) -> None:
        self._arm_states_age_s = seconds

    def set_keys_refused(self, refused: dict[str, bool]) -> None:
        """Whether each keys file (api, admin) is refused now."""
        self._keys_refused = dict(refused)

    def count_retry(self, arm: str) -> None:
        self.engine_retries.inc(1, self._tags(arm))

    def count_resume(self, arm: str) -> None:
        self.streams_resumed.inc(1, self._tags(arm))

    def set_last_reload(self, *, ok: bool) -> None:
        self._last_reload_ok = ok
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Set every gauge to its current value again (see the module docstring)."""
        if self._revision:
            self.config_info.set(1, {MODEL: self.model, REVISION: self._revision})
        self.config_last_reload_success.set(1 if self._last_reload_ok else 0, {MODEL: self.model})
        self.requests_in_flight.set(self._in_flight, {MODEL: self.model})
        self.arm_states_age.set(self._arm_states_age_s, {MODEL: self.model})
        for keys, refused in self._keys_refused.items():
            self.keys_file_refused.set(1 if refused else 0, {MODEL: self.model, KEYS_FILE: keys})
        for arm, weight in self._weights.items():
            self.arm_weight.set(weight, self._tags(arm))
        for arm, ranges in self._k.items():
            for sizes, k in ranges:
                self.arm_speculative_tokens.set(k, self._tags(arm, **{BATCH_SIZES: sizes}))
        for arm, is_running in self._running.items():
            self.arm_running.set(1 if is_running else 0, self._tags(arm))
            self.arm_drained.set(1 if arm in self._drained else 0, self._tags(arm))

    def count_reload(self, result: str) -> None:
        self.config_reloads.inc(1, {MODEL: self.model, RESULT: result})
        self.set_last_reload(ok=result == RELOAD_APPLIED)

    # -- requests ---------------------------------------------------------------------------

    def count_selection(
        self, arm: str, selected_by: str, fallback_from: str | None, unit_bucket: str
    ) -> None:
        self.arm_selections.inc(1, self._tags(arm, **{SELECTED_BY: selected_by}))
        if selected_by in (SELECTED_BY_WEIGHT, SELECTED_BY_STICKY):
            self.unit_selections.inc(1, self._tags(arm, **{UNIT_BUCKET: unit_bucket}))
        if fallback_from is not None:
            self.routing_fallbacks.inc(1, self._tags(fallback_from))

    def count_auth(self, key: str, result: str) -> None:
        """One inference request's authentication, by key name (never the key)."""
        self.api_key_requests.inc(1, {MODEL: self.model, KEY: key, RESULT: result})

    def count_key_tokens(self, key: str, tokens: int) -> None:
        if tokens > 0:  # Ray's counters refuse increments of 0
            self.api_key_output_tokens.inc(tokens, {MODEL: self.model, KEY: key})

    def count_left_out(self, arm: str) -> None:
        self.ab_left_out.inc(1, self._tags(arm))

    def count_request(self, arm: str, endpoint: str, outcome: str) -> None:
        self.requests.inc(1, self._tags(arm, **{ENDPOINT: endpoint, OUTCOME: outcome}))

    def observe_request(
        self,
        arm: str,
        *,
        e2e_s: float,
        ttft_s: float | None,
        tpot_s: float | None,
        output_tokens: int,
        randomized: bool = True,
        key: str = NO_KEY,
        unit_bucket: str,
    ) -> None:
        """One successful request: latencies (TTFT and TPOT only when streamed) and tokens;
        `randomized` ones also in the A/B statistics, under the name of the key that sent it."""
        tags = self._tags(arm)
        self.e2e_latency.observe(e2e_s, tags)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s, tags)
        if tpot_s is not None:
            self._observe_with_square(
                self.time_per_output_token,
                TIME_PER_OUTPUT_TOKEN,
                arm,
                tpot_s,
                randomized,
                key,
                unit_bucket,
            )
        if output_tokens:
            self.output_tokens.inc(output_tokens, tags)
            if e2e_s > 0:
                speed = output_tokens / e2e_s
                self._observe_with_square(
                    self.output_speed,
                    REQUEST_OUTPUT_SPEED,
                    arm,
                    speed,
                    randomized,
                    key,
                    unit_bucket,
                )

    def _observe_with_square(
        self,
        histogram: Histogram,
        name: str,
        arm: str,
        x: float,
        randomized: bool,
        key: str,
        unit_bucket: str,
    ) -> None:
        histogram.observe(x, self._tags(arm))
        if randomized:
            tags = self._tags(arm, **{STAT: name, KEY: key})
            unit_tags = self._tags(arm, **{STAT: name, UNIT_BUCKET: unit_bucket})
            self.stat_count.inc(1, tags)
            self.unit_stat_count.inc(1, unit_tags)
            if x > 0:  # Ray's counters refuse increments of 0
                self.stat_sum.inc(x, tags)
                self.stat_squares.inc(x * x, tags)
                self.unit_stat_sum.inc(x, unit_tags)

    def observe_spec_decode(
        self,
        arm: str,
        stats: dict,
        *,
        randomized: bool = True,
        key: str = NO_KEY,
        unit_bucket: str,
    ) -> None:
        """Count one request's speculative-decoding stats (vLLM's per-request summary)."""
        tags = self._tags(arm)
        for counter, name in (
            (self.drafts, "num_spec_steps"),
            (self.draft_tokens, "num_draft_tokens"),
            (self.accepted_tokens, "num_accepted_draft_tokens"),
        ):
            if stats.get(name):
                counter.inc(stats[name], tags)
        steps = int(stats.get("num_spec_steps") or 0)
        if steps:
            length = 1 + int(stats.get("num_accepted_draft_tokens") or 0) / steps
            self._observe_with_square(
                self.acceptance_length,
                REQUEST_ACCEPTANCE_LENGTH,
                arm,
                length,
                randomized,
                key,
                unit_bucket,
            )
        per_position = accepted_per_position(stats.get("acceptance_histogram") or [])
        for position, accepted in enumerate(per_position):
            if accepted:  # Ray's counters refuse increments of 0
                self.accepted_per_position.inc(
                    accepted, self._tags(arm, **{POSITION: str(position)})
                )
        for position, drafted in enumerate(drafted_per_position(stats)):
            if drafted:
                self.drafted_per_position.inc(drafted, self._tags(arm, **{POSITION: str(position)}))


class CaptureMetrics:
    """What an arm's engine replica keeps of its capture sample (capture/store.py)."""

    def __init__(self, model: str, arm: str) -> None:
        self._tags = {MODEL: model, ARM: arm}
        self.written = Counter(
            CAPTURED_RECORDS, "Records of sampled requests kept in the capture store.", (MODEL, ARM)
        )
        self.dropped = Counter(
            CAPTURE_DROPPED,
            "Records of sampled requests lost: the writer was behind, or the store could not "
            "be written.",
            (MODEL, ARM),
        )

    def count_written(self, n: int) -> None:
        self.written.inc(n, self._tags)

    def count_dropped(self, n: int) -> None:
        self.dropped.inc(n, self._tags)


def scrape(url: str, timeout_s: float = 10) -> Iterator[tuple[str, Sample]]:
    """Every sample on a metrics endpoint (Ray's export port) with its family's type
    ("counter", "gauge", ...): raises httpx.HTTPError when it cannot be read."""
    text = httpx.get(url, timeout=timeout_s).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield family.type, sample
