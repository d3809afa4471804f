"""The acceptance guardrail on real engines: an EAGLE-3 arm whose drafter does not match the
target (the shipped drafter with its vocabulary projection shuffled, so it proposes the wrong
tokens) is drained from the weighted split, with a metric, and returns when the guardrail is
reconfigured. (The drain's end in time is checked with a controlled clock in
tests/unit/test_guardrail.py.)"""

import time

import httpx
import pytest

from specserve import headers
from specserve.config import load_config
from specserve.metrics import ARM_DRAINED, EXPORT_PREFIX, GUARDRAIL_DRAINS, scrape
from tests.conftest import MISMATCHED, MISMATCHED_ARM, MODEL, PROXIES

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ARM = MISMATCHED
GUARDRAIL = """\
guardrail:
  min_acceptance_length: {floor}
  window_s: 600
  min_drafts: 10
  drain_s: 900
"""
# The shipped drafter reaches 1.5-1.9 on chat; a drafter proposing wrong tokens stays near 1.
FLOOR = 1.3


def arms_of(live, n: int) -> list[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [live.http.post(CHAT, json=body).headers[headers.ARM] for _ in range(n)]


def routers_draining(live, arm: str) -> int:
    """How many routers (the dispatch of each HTTP proxy) hold `arm` drained (each exports its
    own gauge series)."""
    return sum(
        int(s.value)
        for _, s in scrape(live.metrics_url)
        if s.name == EXPORT_PREFIX + ARM_DRAINED and s.labels.get("arm") == arm
    )


def mean_acceptance_length(response: httpx.Response) -> float:
    spec = response.json()["metrics"]["speculative_decoding"]
    return 1 + spec["num_accepted_draft_tokens"] / max(1, spec["num_spec_steps"])


def test_a_mismatched_drafter_is_drained_and_returns(live, restore_config, mismatched_drafter):
    original = live.config_path.read_text()
    with_arm = original + MISMATCHED_ARM.format(drafter=mismatched_drafter)
    try:
        live.write_config(with_arm + GUARDRAIL.format(floor=FLOOR))
        live.platform.deploy(load_config(live.config_path))  # what `specserve serve` does
        live.platform.wait_until_running(timeout_s=420)
        check_drain_and_return(live, with_arm)
    finally:
        live.write_config(original)
        live.platform.deploy(load_config(live.config_path))
        live.platform.wait_until_running(timeout_s=300)


def check_drain_and_return(live, with_arm: str) -> None:
    drains_before = live.metric(GUARDRAIL_DRAINS + "_total", arm=ARM)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the moon."}],
        "max_tokens": 32,
    }
    # Override traffic feeds the guardrail of the proxy that routes it, until every proxy's
    # dispatch has drained the arm.
    lengths = []
    for _ in range(120):
        response = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: ARM})
        assert response.status_code == 200
        lengths.append(mean_acceptance_length(response))
        if routers_draining(live, ARM) == PROXIES:
            break
    else:
        raise AssertionError(f"{ARM} was not drained by every router")
    live.wait_for_metric(GUARDRAIL_DRAINS + "_total", drains_before + PROXIES, arm=ARM)
    mean = sum(lengths) / len(lengths)
    print(f"{ARM}: drained after {len(lengths)} requests, mean acceptance length {mean:.2f}")
    assert mean < FLOOR

    # Weighted traffic avoids the drained arm; the override still reaches it.
    assert ARM not in set(arms_of(live, 24))
    forced = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: ARM})
    assert forced.headers[headers.ARM] == ARM

    # A new guardrail setting starts over: the arm takes weighted traffic again.
    live.write_config(with_arm + GUARDRAIL.format(floor=1.0))
    assert ARM in set(arms_of(live, 30))
    deadline = time.monotonic() + 10  # the gauges follow within an export interval
    while routers_draining(live, ARM) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert routers_draining(live, ARM) == 0
