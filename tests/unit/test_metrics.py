"""Router metrics: the arithmetic, and what Ray's exporter really publishes for them."""

import time

import pytest

from specserve import metrics as m
from tests.conftest import free_port, own_ray_cluster


def test_accepted_per_position_from_the_acceptance_histogram():
    # 4 verify steps at k=3 accepted 0, 2, 3 and 3 draft tokens.
    per_position = m.accepted_per_position([1, 0, 1, 2])
    assert per_position == [3, 3, 2]
    assert sum(per_position) == 0 * 1 + 2 * 1 + 3 * 2  # positions add up to the accepted total
    assert m.accepted_per_position([]) == []


@pytest.fixture(scope="module")
def exporter():
    """A real one-CPU Ray node; its metrics agent exports what this process records."""
    port = free_port()
    with own_ray_cluster(num_cpus=1, include_dashboard=False, _metrics_export_port=port):
        yield f"http://127.0.0.1:{port}/metrics"


def scrape_until(url, done, timeout_s: float = 30, tick=None) -> dict:
    """Samples by (name, frozenset(own labels)) once `done(samples)`; `tick()` between scrapes."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = {}
        for _, s in m.scrape(url, timeout_s=5):
            if s.name.startswith(m.EXPORT_PREFIX + m.PREFIX):
                own = {k: v for k, v in s.labels.items() if k in OWN_LABELS}
                samples[(s.name, frozenset(own.items()))] = s.value
        if done(samples) or time.monotonic() > deadline:
            return samples
        if tick is not None:
            tick()
        time.sleep(0.5)


OWN_LABELS = {m.MODEL, m.ARM, m.OUTCOME, m.ENDPOINT, m.POSITION, m.RESULT, m.REVISION}
OWN_LABELS |= {m.SELECTED_BY, m.STAT, m.KEY, m.BATCH_SIZES, m.KEYS_FILE, m.UNIT_BUCKET, "le"}


@pytest.mark.own_cluster
def test_router_metrics_as_ray_exports_them(exporter):
    metrics = m.RouterMetrics("m1")
    metrics.set_active_config("rev1", {"a": 1, "b": 3})
    metrics.set_active_config("rev2", {"a": 2}, {"a": [("1-4", 3), ("5+", 0)]})  # b removed
    metrics.set_running({"a": True})
    metrics.count_reload(m.RELOAD_INVALID)
    metrics.count_selection("a", m.SELECTED_BY_STICKY, fallback_from="b", unit_bucket="5")
    metrics.count_selection("a", m.SELECTED_BY_OVERRIDE, fallback_from=None, unit_bucket="6")
    metrics.count_request("a", "chat", m.OUTCOME_OK)
    metrics.observe_request(
        "a", e2e_s=0.3, ttft_s=0.02, tpot_s=0.03, output_tokens=7, key="team-a", unit_bucket="5"
    )
    stats = {
        "acceptance_histogram": [1, 0, 1, 2],
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 8,
        "num_draft_tokens": 12,
    }
    metrics.observe_spec_decode("a", stats, unit_bucket="5")
    metrics.count_drain("a")
    metrics.count_left_out("a")
    metrics.count_retry("a")
    metrics.count_resume("a")
    metrics.count_resume("a")
    metrics.count_auth("team-a", m.AUTH_ACCEPTED)
    metrics.count_auth(m.NO_KEY, m.AUTH_INVALID)
    metrics.count_key_tokens("team-a", 7)
    metrics.set_arm_states_age(2.5)
    metrics.set_keys_refused({"api": True, "admin": False})
    capture = m.CaptureMetrics("m1", "a")  # an arm's engine replica
    capture.count_written(3)
    capture.count_dropped(1)

    def sample(name, **labels):
        return (m.EXPORT_PREFIX + name, frozenset({"model": "m1", **labels}.items()))

    def settled(samples):
        # Every name exported, and the superseded gauge series aged out.
        names = {name for name, _ in samples}
        return names == m.exported_names() and sample(m.CONFIG_INFO, revision="rev1") not in samples

    # Ray drops a gauge series two export intervals after its last update: the router sets its
    # gauges again every second, and what it no longer sets disappears.
    got = scrape_until(exporter, settled, tick=metrics.refresh_gauges)
    assert {name for name, _ in got} == m.exported_names()

    def value(name, **labels):
        return got[sample(name, **labels)]

    assert value(m.SPEC_DRAFTS + "_total", arm="a") == 4
    assert value(m.SPEC_DRAFT_TOKENS + "_total", arm="a") == 12
    assert value(m.SPEC_ACCEPTED_TOKENS + "_total", arm="a") == 8
    positions = [
        value(m.SPEC_ACCEPTED_PER_POSITION + "_total", arm="a", position=str(p)) for p in range(3)
    ]
    assert positions == [3, 3, 2]
    drafted = [
        value(m.SPEC_DRAFTED_PER_POSITION + "_total", arm="a", position=str(p)) for p in range(3)
    ]
    assert drafted == [4, 4, 4]  # 12 draft tokens in 4 steps: k = 3 every step
    assert value(m.ARM_SPECULATIVE_TOKENS, arm="a", batch_sizes="1-4") == 3
    assert value(m.ARM_SPECULATIVE_TOKENS, arm="a", batch_sizes="5+") == 0
    assert value(m.OUTPUT_TOKENS + "_total", arm="a") == 7
    assert value(m.REQUESTS + "_total", arm="a", endpoint="chat", outcome="ok") == 1
    assert value(m.ARM_SELECTIONS + "_total", arm="a", selected_by="sticky") == 1
    assert value(m.ROUTING_FALLBACKS + "_total", arm="b") == 1
    assert value(m.GUARDRAIL_DRAINS + "_total", arm="a") == 1
    assert value(m.ARM_DRAINED, arm="a") == 1
    assert value(m.ENGINE_RETRIES + "_total", arm="a") == 1
    assert value(m.STREAMS_RESUMED + "_total", arm="a") == 2
    assert value(m.API_KEY_REQUESTS + "_total", key="team-a", result="accepted") == 1
    assert value(m.API_KEY_REQUESTS + "_total", key="-", result="invalid") == 1
    assert value(m.API_KEY_OUTPUT_TOKENS + "_total", key="team-a") == 7
    assert value(m.ARM_STATES_AGE) == 2.5
    assert value(m.KEYS_FILE_REFUSED, keys="api") == 1
    assert value(m.KEYS_FILE_REFUSED, keys="admin") == 0
    assert value(m.CAPTURED_RECORDS + "_total", arm="a") == 3
    assert value(m.CAPTURE_DROPPED + "_total", arm="a") == 1
    assert value(m.TIME_TO_FIRST_TOKEN + "_bucket", arm="a", le="0.025") == 1
    assert value(m.TIME_TO_FIRST_TOKEN + "_bucket", arm="a", le="0.01") == 0
    assert value(m.TIME_PER_OUTPUT_TOKEN + "_count", arm="a") == 1

    # The per-request figures the A/B report compares, each with its exact sum and squares,
    # under the sending key's name (the spec-decode stats came without one).
    def moments(stat, key="team-a"):
        return (
            value(stat + "_count", arm="a"),
            value(m.REQUEST_STAT_SUM + "_total", arm="a", stat=stat, key=key),
            value(m.REQUEST_STAT_SQUARES + "_total", arm="a", stat=stat, key=key),
        )

    assert moments(m.REQUEST_OUTPUT_SPEED) == pytest.approx((1, 7 / 0.3, (7 / 0.3) ** 2))
    assert moments(m.REQUEST_ACCEPTANCE_LENGTH, key=m.NO_KEY) == (1, 3, 9)
    assert moments(m.TIME_PER_OUTPUT_TOKEN) == pytest.approx((1, 0.03, 0.03**2))
    # The same by the bucket of the request's randomisation unit; a forced selection has none.
    for stat, total in ((m.REQUEST_OUTPUT_SPEED, 7 / 0.3), (m.REQUEST_ACCEPTANCE_LENGTH, 3)):
        assert value(m.UNIT_STAT_COUNT + "_total", arm="a", stat=stat, unit_bucket="5") == 1
        assert value(m.UNIT_STAT_SUM + "_total", arm="a", stat=stat, unit_bucket="5") == (
            pytest.approx(total)
        )
    assert value(m.UNIT_SELECTIONS + "_total", arm="a", unit_bucket="5") == 1
    assert value(m.AB_LEFT_OUT + "_total", arm="a") == 1
    assert sample(m.UNIT_SELECTIONS + "_total", arm="a", unit_bucket="6") not in got
    # Only the active revision and the configured arms remain.
    assert value(m.CONFIG_INFO, revision="rev2") == 1
    assert sample(m.CONFIG_INFO, revision="rev1") not in got
    assert value(m.ARM_WEIGHT, arm="a") == 2
    assert sample(m.ARM_WEIGHT, arm="b") not in got
    assert value(m.ARM_RUNNING, arm="a") == 1
    assert value(m.CONFIG_RELOADS + "_total", result="invalid") == 1
    assert value(m.CONFIG_LAST_RELOAD_SUCCESS) == 0
