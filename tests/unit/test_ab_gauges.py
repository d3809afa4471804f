"""What the A/B report and the loop read from the router's gauges (ab/prometheus.py), against a
real Prometheus. Ray's exporter drops a gauge its process has not set for two report intervals,
and on a loaded node the router's gauges leave scrapes for seconds at a time; a metrics port
whose exposition the test chooses (tests/conftest.py) plays those gaps."""

from __future__ import annotations

import contextlib
import math
import time

import pytest

from specserve.ab.prometheus import GAUGE_LOOKBACK_S, Prometheus, PrometheusError
from specserve.metrics import (
    ARM,
    ARM_DRAINED,
    ARM_SELECTIONS,
    ARM_WEIGHT,
    CONFIG_INFO,
    EXPORT_PREFIX,
    REVISION,
    SELECTED_BY,
    SELECTED_BY_OVERRIDE,
    SELECTED_BY_WEIGHT,
)
from tests.conftest import metrics_port, prometheus_server, until_scraped

MODEL = "m"


def gauges(revision: str, weights: dict[str, float], drained: set[str]) -> list[str]:
    lines = [f'{EXPORT_PREFIX}{CONFIG_INFO}{{model="{MODEL}",{REVISION}="{revision}"}} 1']
    for arm, weight in weights.items():
        labels = f'model="{MODEL}",{ARM}="{arm}"'
        lines.append(f"{EXPORT_PREFIX}{ARM_WEIGHT}{{{labels}}} {weight}")
        lines.append(f"{EXPORT_PREFIX}{ARM_DRAINED}{{{labels}}} {int(arm in drained)}")
    return lines


@contextlib.contextmanager
def counter_scraped(tmp_path, series: str, value: float):
    """A real Prometheus scraping a port that exports `series` at `value`, once it holds it:
    (the port, whose lines the test changes, and a client)."""
    with (
        metrics_port([f"{series} {value:g}"]) as port,
        prometheus_server(tmp_path, port.target) as url,
    ):
        prometheus = Prometheus(url)
        until_scraped(prometheus, f"{series} == {value:g}")
        yield port, prometheus


@pytest.mark.ray  # a Prometheus server of its own
def test_gauges_missing_from_a_few_scrapes_still_give_the_model_revision_weights_and_drains(
    tmp_path,
):
    with (
        metrics_port(gauges("r1", {"a": 1.0}, set())) as port,
        prometheus_server(tmp_path, port.target) as url,
    ):
        prometheus = Prometheus(url)

        def scraped(revision: str) -> None:
            until_scraped(prometheus, f'{EXPORT_PREFIX}{CONFIG_INFO}{{{REVISION}="{revision}"}}')

        scraped("r1")
        first = time.time()
        time.sleep(2)  # r1 stays a few scrapes, then a new revision: a challenger at 0.5, drained
        port.lines = gauges("r2", {"a": 0.5, "c": 0.5}, {"c"})
        scraped("r2")
        time.sleep(2)
        port.lines = []  # the exporter drops every gauge: the gap
        until_scraped(prometheus, f"{EXPORT_PREFIX}{CONFIG_INFO}", present=False)

        now = time.time()  # in the gap: no gauge at this instant
        model = prometheus.model()
        revision, start = prometheus.revision_start(MODEL, now)
        weights = {arm: t.weight for arm, t in prometheus.totals(MODEL, first, now).items()}
        drained = prometheus.drained("c", now), prometheus.drained("a", now)
        # Past the lookback, what was last exported has aged out: asked about an instant
        # after it (Prometheus evaluates at any instant), with no sample since the gap began.
        later = now + GAUGE_LOOKBACK_S + 5
        with pytest.raises(PrometheusError, match=f"no {EXPORT_PREFIX}{CONFIG_INFO} series"):
            prometheus.model(at=later)
        aged = prometheus.totals(MODEL, first, later)

    assert model == MODEL
    # The newest revision, not the one whose value happens to be larger: both were 1.
    assert revision == "r2" and start > first
    assert weights == {"a": 0.5, "c": 0.5}
    assert drained == (True, False)
    assert all(t.weight == 0 for t in aged.values())


@pytest.mark.ray  # a Prometheus server of its own
def test_a_counter_missing_from_the_scrapes_when_the_experiment_begins_counts_from_its_last_value(
    tmp_path,
):
    """The report's totals are each counter's growth since the experiment began: a counter in
    an export gap at that moment still starts from its last value, not from 0."""
    series = f'{EXPORT_PREFIX}{ARM_SELECTIONS}_total{{model="{MODEL}",{ARM}="a"}}'
    with counter_scraped(tmp_path, series, 10) as (port, prometheus):
        port.lines = []  # the gap
        until_scraped(prometheus, series, present=False)
        since = time.time()  # the experiment begins in the gap
        port.lines = [f"{series} 13"]
        until_scraped(prometheus, f"{series} == 13")
        grown = prometheus.counts(series, (ARM,), since, time.time())
    assert grown == {("a",): 3}


@pytest.mark.ray  # a Prometheus server of its own
def test_a_challenger_named_as_an_earlier_one_counts_only_the_requests_since_it_was_added(
    tmp_path,
):
    """The loop starts its experiment once the router has sent the challenger a request. A rerun
    with the same candidate reuses its name, and the earlier run's count read whole started the
    experiment before the new engine served: its traffic share read 0 %, a false mismatch."""
    series = (
        f'{EXPORT_PREFIX}{ARM_SELECTIONS}_total{{model="{MODEL}",{ARM}="c",'
        f'{SELECTED_BY}="{SELECTED_BY_WEIGHT}"}}'
    )
    override = series.replace(SELECTED_BY_WEIGHT, SELECTED_BY_OVERRIDE)
    with counter_scraped(tmp_path, series, 40) as (port, prometheus):
        added = time.time()  # the earlier run's 40 requests are in Prometheus
        time.sleep(2)
        port.lines = [f"{series} 40", f"{override} 5"]  # forced requests: not randomized
        until_scraped(prometheus, f"{override} == 5")
        before_serving = prometheus.selections("c", added, time.time())
        port.lines = [f"{series} 41", f"{override} 5"]
        until_scraped(prometheus, f"{series} == 41")
        serving = prometheus.selections("c", added, time.time())
    assert (before_serving, serving) == (0, 1)


@pytest.mark.ray  # a Prometheus server of its own
def test_a_counter_grows_window_by_window_and_the_windows_add_up_to_its_growth(tmp_path):
    """The report's intervals are two-way over windows of time: each window gets what the
    counter grew by in it. Growth in an export gap lands in the window that sees it next, a
    restarted counter counts from 0, and the windows add up to what `counts` finds."""
    series = f'{EXPORT_PREFIX}{ARM_SELECTIONS}_total{{model="{MODEL}",{ARM}="a"}}'
    with counter_scraped(tmp_path, series, 10) as (port, prometheus):
        since = time.time()
        for lines, value in (([f"{series} 13"], 13), ([], None), ([f"{series} 20"], 20)):
            time.sleep(3)  # three seconds apart: windows of two see each step on its own
            port.lines = lines
            if value is None:  # the gap: missing from the scrapes for longer than a window
                until_scraped(prometheus, series, present=False)
            else:
                until_scraped(prometheus, f"{series} == {value}")
        time.sleep(3)
        port.lines = [f"{series} 2"]  # the process restarted
        until_scraped(prometheus, f"{series} == 2")
        now = time.time()
        windows = prometheus.windowed(series, (ARM,), since, now, 2)[("a",)]
        before_restart = prometheus.windowed(series, (ARM,), since, now - 2, 2)[("a",)]
        whole = prometheus.counts(series, (ARM,), since, now - 2)
    assert [grown for _, grown in sorted(windows.items()) if grown] == [3, 7, 2]
    assert max(windows) == math.ceil((now - since) / 2) - 1  # the last window ends now
    assert sum(before_restart.values()) == whole[("a",)] == 10
