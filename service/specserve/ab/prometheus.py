"""What the A/B report reads from a Prometheus server (its HTTP API, /api/v1) scraping specserve:
per-arm totals since the experiment began, and per-arm series over time."""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from specserve.ab.sequential import Clustered, Moments
from specserve.metrics import (
    AB_LEFT_OUT,
    AB_STATS,
    ARM,
    ARM_DRAINED,
    ARM_SELECTIONS,
    ARM_WEIGHT,
    CONFIG_INFO,
    EXPORT_PREFIX,
    KEY,
    OUTCOME,
    OUTCOME_SERVER_ERROR,
    POSITION,
    REQUEST_OUTPUT_SPEED,
    REQUEST_STAT_COUNT,
    REQUEST_STAT_SQUARES,
    REQUEST_STAT_SUM,
    REQUESTS,
    REQUESTS_IN_FLIGHT,
    REVISION,
    SELECTED_BY,
    SELECTED_BY_STICKY,
    SELECTED_BY_WEIGHT,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_DRAFTED_PER_POSITION,
    SPEC_DRAFTS,
    STAT,
    UNIT_BUCKET,
    UNIT_SELECTIONS,
    UNIT_STAT_COUNT,
    UNIT_STAT_SUM,
)

# How far back the start of the active config revision is looked for.
REVISION_LOOKBACK = "7d"
# Gauges are read as their last value in this window, not at one instant: a gauge is gone from
# Prometheus from the first scrape that misses it (Ray's exporter drops one its process has not
# set for two report intervals; a scrape that times out loses them all), and on a loaded node
# the router's gauges were missing for 10-15 s at a time (2 cores beside three busy engines).
GAUGE_LOOKBACK_S = 30
# A counter's value when an experiment begins: its last sample in this long before, so that a
# gap in its export at that moment (as the gauges', above) is not read as a series born later.
# Gaps last: on a 2-core node, the loop's A/B counted 72 requests in a window in which the arms
# answered 25 (a sample-ratio mismatch that was none), as series from earlier traffic had no
# sample in the 600 s before it (adapt training and the challenger's engine starting had the
# CPUs) and were read as born in the experiment. A series older than this is counted whole
# again; one that was reset (its process restarted) counts from zero.
COUNTER_LOOKBACK_S = 24 * 3600
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class PrometheusError(RuntimeError):
    """Prometheus could not be reached, refused a query, or holds no specserve data."""


def parse_since(text: str, now: float) -> float:
    """`30m`, `2h`, `1d` (ago), a Unix time or an ISO 8601 time -> Unix seconds."""
    if match := _DURATION.match(text):
        return now - float(match[1]) * _SECONDS[match[2]]
    try:
        return float(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected a duration (30m, 2h, 1d), a Unix time or an ISO time"
        ) from None


@dataclass
class ArmTotals:
    """One arm's figures between the experiment's start and now."""

    weight: float = 0.0
    # Requests the weights or a sticky key sent here (override requests are not randomized).
    randomized: float = 0.0
    # Of those, the ones a sticky key sent (their unit is the key; the others' the request).
    sticky: float = 0.0
    stats: dict[str, Moments] = field(default_factory=dict)
    # The same figures per group of randomisation units and window of time (the report's
    # intervals when present).
    clustered: dict[str, Clustered] = field(default_factory=dict)
    # Randomized selections per group of units (the sample-ratio check's).
    selections_by_bucket: dict[str, float] = field(default_factory=dict)
    # Randomized requests left out of the statistics: their prompt was trained on.
    left_out: float = 0.0
    # The primary figure (per-user tokens/s) per sending key's name: each key's segment.
    by_key: dict[str, Moments] = field(default_factory=dict)
    drafts: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)
    drafted_per_position: list[float] = field(default_factory=list)


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 30) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s)

    def _get(self, path: str, params: dict) -> dict:
        try:
            response = self.http.get(f"{self.url}/api/v1/{path}", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {exc}") from exc
        try:
            answer = response.json()
        except ValueError:
            raise PrometheusError(
                f"{self.url} is not a Prometheus API (HTTP {response.status_code})"
            ) from None
        if answer.get("status") != "success":
            raise PrometheusError(f"query {params.get('query')!r}: {answer.get('error')}")
        return answer["data"]

    def vector(self, query: str, at: float) -> list[tuple[dict[str, str], float]]:
        data = self._get("query", {"query": query, "time": at})
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def matrix(
        self, query: str, start: float, end: float, step_s: float
    ) -> list[tuple[dict[str, str], dict[float, float]]]:
        params = {"query": query, "start": start, "end": end, "step": step_s}
        data = self._get("query_range", params)
        return [(r["metric"], {float(t): float(v) for t, v in r["values"]}) for r in data["result"]]

    # -- what the report needs --------------------------------------------------------------

    def model(self, at: float | None = None) -> str:
        """The one model served at `at` (now by default)."""
        found = self.vector(_last(_name(CONFIG_INFO)), time.time() if at is None else at)
        models = {labels["model"] for labels, _ in found if "model" in labels}
        if not models:
            raise PrometheusError(
                f"no {_name(CONFIG_INFO)} series at {self.url}: is it scraping specserve's "
                "metrics port?"
            )
        if len(models) > 1:
            raise PrometheusError(f"several models are served ({sorted(models)}): pass --model")
        return models.pop()

    def revision_start(self, model: str, now: float) -> tuple[str, float]:
        """The active config revision (the one seen last) and when Prometheus first saw it."""
        info = f'{_name(CONFIG_INFO)}{{model="{model}"}}'
        last_seen = f"max_over_time(timestamp({info})[{GAUGE_LOOKBACK_S}s:1s])"
        found = self.vector(f"max by ({REVISION}) ({last_seen})", now)
        if not found:
            raise PrometheusError(f"no active config revision of model {model!r}")
        revision = max(found, key=lambda r: r[1])[0][REVISION]
        series = f'{_name(CONFIG_INFO)}{{model="{model}",revision="{revision}"}}'
        query = f"min_over_time(timestamp(max({series}))[{REVISION_LOOKBACK}:15s])"
        first = self.vector(query, now)
        return revision, (first[0][1] if first else now)

    def totals(
        self, model: str, since: float, now: float, window_s: float = math.inf
    ) -> dict[str, ArmTotals]:
        """Every counter the report reads, as it grew in (since, now] (`counts`: exact, where
        increase() would miss the first request of every series a challenger begins); the
        statistics per group of units also per window of `window_s` (`windowed`)."""
        arms: dict[str, ArmTotals] = defaultdict(ArmTotals)
        selector = f'model="{model}"'

        def grown(name: str, by: tuple[str, ...] = (ARM,), extra: str = "") -> dict:
            return self.counts(f"{name}_total{{{selector}{extra}}}", by, since, now)

        for labels, value in self.vector(
            f"max by ({ARM}) ({_last(_name(ARM_WEIGHT) + '{' + selector + '}')})", now
        ):
            arms[labels[ARM]].weight = value
        selections = _name(ARM_SELECTIONS)
        randomized = f',{SELECTED_BY}=~"{SELECTED_BY_WEIGHT}|{SELECTED_BY_STICKY}"'
        for (arm,), value in grown(selections, extra=randomized).items():
            arms[arm].randomized = value
        sticky = f',{SELECTED_BY}="{SELECTED_BY_STICKY}"'
        for (arm,), value in grown(selections, extra=sticky).items():
            arms[arm].sticky = value
        for (arm, bucket), value in grown(_name(UNIT_SELECTIONS), (ARM, UNIT_BUCKET)).items():
            arms[arm].selections_by_bucket[bucket] = value

        def moments(stat: str, by: tuple[str, ...]) -> dict[tuple[str, ...], Moments]:
            parts: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
            for part, counter in (
                ("n", REQUEST_STAT_COUNT),
                ("sum", REQUEST_STAT_SUM),
                ("squares", REQUEST_STAT_SQUARES),
            ):
                for group, value in grown(_name(counter), by, f',{STAT}="{stat}"').items():
                    parts[group][part] = value
            return {
                group: Moments(got["n"], got.get("sum", 0.0), got.get("squares", 0.0))
                for group, got in parts.items()
                if got.get("n", 0) > 0
            }

        for stat in AB_STATS:
            for (arm,), found in moments(stat, (ARM,)).items():
                arms[arm].stats[stat] = found
            for arm, cells in self._cells(selector, stat, since, now, window_s).items():
                arms[arm].clustered[stat] = Clustered(tuple(cells))
        for (arm, key), found in moments(REQUEST_OUTPUT_SPEED, (ARM, KEY)).items():
            arms[arm].by_key[key] = found
        for (arm,), value in grown(_name(AB_LEFT_OUT)).items():
            arms[arm].left_out = value
        for (arm,), value in grown(_name(SPEC_DRAFTS)).items():
            arms[arm].drafts = value
        for metric, attribute in (
            (SPEC_ACCEPTED_PER_POSITION, "accepted_per_position"),
            (SPEC_DRAFTED_PER_POSITION, "drafted_per_position"),
        ):
            per_position = grown(_name(metric), (ARM, POSITION))
            for (arm, position), value in sorted(per_position.items(), key=lambda r: int(r[0][1])):
                positions = getattr(arms[arm], attribute)
                positions.extend([0.0] * (int(position) + 1 - len(positions)))
                positions[int(position)] = value
        return dict(arms)

    def counts(
        self, series: str, by: tuple[str, ...], since: float, now: float
    ) -> dict[tuple[str, ...], float]:
        """What a counter grew by in (since, now], summed by the labels `by`: each series' last
        value in the window less its value at `since` (0 for one that did not exist yet, all of
        it after a reset). Unlike increase(), which cannot see a series' first increment, this
        counts series born in the window (a bucket's first request) and ones that ended in it."""
        window = f"{max(1, math.ceil(now - since))}s"
        before = self._counters_at(series, since)
        grown: dict[tuple[str, ...], float] = defaultdict(float)
        for labels, last in self.vector(f"last_over_time({series}[{window}])", now):
            start = before.get(_series_key(labels), 0.0)
            grown[tuple(labels.get(name, "") for name in by)] += (
                last - start if last >= start else last
            )
        return dict(grown)

    def _counters_at(self, series: str, at: float) -> dict[frozenset, float]:
        """Each series' value at `at`: its last sample within COUNTER_LOOKBACK_S before."""
        last = f"last_over_time({series}[{COUNTER_LOOKBACK_S}s])"
        return {_series_key(labels): value for labels, value in self.vector(last, at)}

    def windowed(
        self, series: str, by: tuple[str, ...], since: float, now: float, window_s: float
    ) -> dict[tuple[str, ...], dict[int, float]]:
        """What a counter grew by in each window of (since, now], summed by the labels `by`:
        windows of `window_s` back from `now` (the first one shorter), numbered from 0. As
        `counts`, a window at a time: each series' value at a window's end (carried over where a
        scrape was missed, so its growth lands in the next window) less its value at the end of
        the one before. The windows' growths add up to `counts`' (more where the counter
        restarted: `counts` sees its last value only)."""
        if not math.isfinite(window_s):
            return {key: {0: value} for key, value in self.counts(series, by, since, now).items()}
        step = math.ceil(window_s)
        ends = math.ceil((now - since) / step)  # window i ends at now - (ends - 1 - i) * step
        # In whole milliseconds, as Prometheus reads times: its last step then falls on `now`
        # exactly, where two roundings of sub-millisecond times could put it past and drop it.
        now = round(now, 3)
        first = round(now - (ends - 1) * step, 3)
        before = self._counters_at(series, since)
        grown: dict[tuple[str, ...], dict[int, float]] = defaultdict(lambda: defaultdict(float))
        found = self.matrix(f"last_over_time({series}[{step}s])", first, now, step)
        for labels, values in found:
            value = before.get(_series_key(labels), 0.0)
            key = tuple(labels.get(name, "") for name in by)
            for t, last in sorted(values.items()):
                window = round((t - first) / step)
                grown[key][window] += last - value if last >= value else last
                value = last
        return {key: dict(windows) for key, windows in grown.items()}

    def _cells(
        self, selector: str, stat: str, since: float, now: float, window_s: float
    ) -> dict[str, list[tuple[str, int, float, float]]]:
        """Per arm, (group of units, window, count, sum) of `stat` in each cell with requests."""
        by = (ARM, UNIT_BUCKET)
        of_stat = f'{{{selector},{STAT}="{stat}"}}'
        sums = self.windowed(_name(UNIT_STAT_SUM) + "_total" + of_stat, by, since, now, window_s)
        counts = self.windowed(
            _name(UNIT_STAT_COUNT) + "_total" + of_stat, by, since, now, window_s
        )
        cells: dict[str, list[tuple[str, int, float, float]]] = defaultdict(list)
        for (arm, bucket), windows in sorted(counts.items()):
            for window, count in sorted(windows.items()):
                if count > 0:
                    total = sums.get((arm, bucket), {}).get(window, 0.0)
                    cells[arm].append((bucket, window, count, total))
        return cells

    def selections(self, arm: str, since: float, at: float) -> float:
        """Weighted and sticky requests the router sent `arm` in (since, at] (what the report's
        traffic check counts): `counts`, so an earlier arm of the same name adds nothing. The
        router selects only running arms, and a request counts here when it starts, not when
        it ends."""
        selected = f',{SELECTED_BY}=~"{SELECTED_BY_WEIGHT}|{SELECTED_BY_STICKY}"'
        series = f'{_name(ARM_SELECTIONS)}_total{{{ARM}="{arm}"{selected}}}'
        return self.counts(series, (), since, at).get((), 0.0)

    def errors(self, arm: str, since: float, at: float) -> tuple[float, float]:
        """(requests that failed on the platform's side, all requests) of `arm` in (since, at]:
        what its request counter grew by, by outcome (`counts`)."""
        of_arm = f'{_name(REQUESTS)}_total{{{ARM}="{arm}"'
        failed = self.counts(f'{of_arm},{OUTCOME}="{OUTCOME_SERVER_ERROR}"}}', (), since, at)
        answered = self.counts(of_arm + "}", (), since, at)
        return failed.get((), 0.0), answered.get((), 0.0)

    def drained(self, arm: str, at: float) -> bool:
        """Whether any router's acceptance guardrail holds `arm` drained."""
        series = f'{_name(ARM_DRAINED)}{{{ARM}="{arm}"}}'
        found = self.vector(f"max({_last(series)})", at)
        return bool(found and found[0][1] > 0)

    def speed_by_load(
        self, model: str, since: float, now: float, step_s: float
    ) -> tuple[dict[str, dict[float, tuple[float, float]]], dict[float, float]]:
        """Per arm and step: (requests/s, sum of per-request tokens/s per second) over the
        preceding window; and the mean requests in flight (all arms) in that window."""
        window = f"{max(60, math.ceil(step_s))}s"
        selector = f'model="{model}"'
        count = f'{_name(REQUEST_STAT_COUNT)}_total{{{selector},{STAT}="{REQUEST_OUTPUT_SPEED}"}}'
        total = f'{_name(REQUEST_STAT_SUM)}_total{{{selector},{STAT}="{REQUEST_OUTPUT_SPEED}"}}'
        parts = {
            part: self.matrix(f"sum by ({ARM}) (rate({series}[{window}]))", since, now, step_s)
            for part, series in (("_count", count), ("_sum", total))
        }
        speed: dict[str, dict[float, tuple[float, float]]] = defaultdict(dict)
        sums = {labels[ARM]: values for labels, values in parts["_sum"]}
        for labels, counts in parts["_count"]:
            for t, rate in counts.items():
                speed[labels[ARM]][t] = (rate, sums.get(labels[ARM], {}).get(t, 0.0))
        load_query = f"sum(avg_over_time({_name(REQUESTS_IN_FLIGHT)}{{{selector}}}[{window}]))"
        load = self.matrix(load_query, since, now, step_s)
        return dict(speed), (load[0][1] if load else {})


def _series_key(labels: dict[str, str]) -> frozenset[tuple[str, str]]:
    """A series' identity across queries (functions drop the metric's name, selectors keep it)."""
    return frozenset((k, v) for k, v in labels.items() if k != "__name__")


def _name(metric: str) -> str:
    """A metric's name as Prometheus stores it (Ray's exporter prefix)."""
    return EXPORT_PREFIX + metric


def _last(series: str) -> str:
    """A gauge's last value within GAUGE_LOOKBACK_S, gaps in its export bridged."""
    return f"last_over_time({series}[{GAUGE_LOOKBACK_S}s])"
