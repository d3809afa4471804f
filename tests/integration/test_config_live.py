"""A bad config file is rejected while the last good one keeps serving."""

import pytest

from specserve import headers
from tests.conftest import MODEL, PROXIES


@pytest.mark.parametrize(
    "bad", ["arms: [", "model: {name: x, source: y}\narms:\n  - {name: a, weight: -1}\n"]
)
def test_invalid_file_keeps_last_good_config(live, restore_config, bad):
    good_revision = live.revision()
    invalid_before = live.metric("specserve_config_reloads_total", result="invalid")
    live.write_config(bad, expect_applied=False)

    # Counted once by the dispatch of each proxy.
    assert live.metric("specserve_config_reloads_total", result="invalid") == (
        invalid_before + PROXIES
    )
    assert live.metric("specserve_config_last_reload_successful") == 0
    assert live.metric("specserve_config_info", revision=good_revision) == 1
    response = live.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    )
    assert response.status_code == 200
    assert response.headers[headers.CONFIG_REVISION] == good_revision


def test_arm_that_is_not_running_gets_no_weighted_or_sticky_traffic(live, restore_config):
    from specserve.router.selection import sticky_arm
    from tests.conftest import render_config

    # A configured arm whose engine is not deployed (the Serve config has not caught up yet).
    ghost = render_config() + "  - {name: ghost, weight: 100}\n"
    revision = live.write_config(ghost)
    ready = live.http.get("/ready")
    assert ready.status_code == 503
    assert ready.json() == {
        "ready": False,
        "revision": revision,
        "waiting": {"ghost": "NOT_DEPLOYED"},
        "draining": False,
        "dispatch": True,
    }

    fallbacks_before = live.metric("specserve_routing_fallbacks_total", arm="ghost")
    keys = [f"ghost-{i}" for i in range(16)]
    for key in keys:
        response = live.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            headers={"x-session-id": key},
        )
        assert response.status_code == 200, response.text
        # Each key goes to its best-scoring running arm: where it would be without the ghost.
        assert response.headers[headers.ARM] == sticky_arm(
            key, {"no-spec": 1, "ngram": 1}, live.sticky_salt
        )
    all_weights = {"no-spec": 1, "ngram": 1, "ghost": 100}
    expected = sum(sticky_arm(key, all_weights, live.sticky_salt) == "ghost" for key in keys)
    assert expected > 0
    counted = live.wait_for_metric(
        "specserve_routing_fallbacks_total", fallbacks_before + expected, arm="ghost"
    )
    assert counted == fallbacks_before + expected

    response = live.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={headers.ARM_OVERRIDE: "ghost"},
    )
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "arm 'ghost' is not running"
    assert response.headers[headers.CONFIG_REVISION] == revision
    # The running arms keep serving meanwhile, overrides included.
    response = live.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={headers.ARM_OVERRIDE: "ngram"},
    )
    assert response.status_code == 200
