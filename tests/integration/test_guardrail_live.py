"""The acceptance guardrail on real engines: an arm whose drafts fall short of the configured
floor is drained from the weighted split, with a metric, and returns. The floor is set where the
ngram arm cannot reach it (mean acceptance length 3.9 of at most 4 at k = 3), which is what a
drafter that does not match its target looks like to the guardrail. (The drain's end in time is
checked with a controlled clock in tests/unit/test_guardrail.py.)"""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve import headers
from specserve.metrics import ARM_DRAINED, EXPORT_PREFIX, GUARDRAIL_DRAINS
from tests.conftest import MODEL, ROUTER_REPLICAS

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
GUARDRAIL = """\
guardrail:
  min_acceptance_length: 3.9
  window_s: 600
  min_drafts: 10
  drain_s: {drain_s}
"""
# A prompt the ngram drafter finds matches in, so it drafts (and is judged).
REPETITIVE = "Repeat exactly, ten times: red green blue, red green blue, red green blue."


def arms_of(live, n: int) -> list[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [live.http.post(CHAT, json=body).headers[headers.ARM] for _ in range(n)]


def replicas_draining(live, arm: str) -> int:
    """How many router replicas hold `arm` drained (each exports its own gauge series)."""
    text = httpx.get(live.metrics_url, timeout=10).text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == EXPORT_PREFIX + ARM_DRAINED and sample.labels.get("arm") == arm
    )


def test_an_arm_below_the_acceptance_floor_is_drained_and_returns(live, restore_config):
    original = live.config_path.read_text()
    live.write_config(original + GUARDRAIL.format(drain_s=900))
    drains_before = live.metric(GUARDRAIL_DRAINS + "_total", arm="ngram")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": REPETITIVE}],
        "max_tokens": 48,
    }
    # Override traffic feeds the guardrail of whichever router replica serves it, until every
    # replica has drained the arm (the proxy may favour one replica for a while).
    for _ in range(120):
        response = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: "ngram"})
        assert response.status_code == 200
        if replicas_draining(live, "ngram") == ROUTER_REPLICAS:
            break
    else:
        raise AssertionError("ngram was not drained by every router replica")
    live.wait_for_metric(GUARDRAIL_DRAINS + "_total", drains_before + ROUTER_REPLICAS, arm="ngram")

    # Weighted traffic avoids the drained arm; the override still reaches it.
    assert set(arms_of(live, 16)) == {"no-spec"}
    forced = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: "ngram"})
    assert forced.headers[headers.ARM] == "ngram"

    # A new guardrail setting starts over: the arm takes weighted traffic again.
    live.write_config(original + GUARDRAIL.format(drain_s=901).replace("3.9", "1.0"))
    assert "ngram" in set(arms_of(live, 24))
    deadline = time.monotonic() + 10  # the gauges follow within an export interval
    while replicas_draining(live, "ngram") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replicas_draining(live, "ngram") == 0
