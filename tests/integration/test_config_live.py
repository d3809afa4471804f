"""A bad config file is rejected while the last good one keeps serving."""

import pytest

from specserve import headers
from tests.conftest import MODEL

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "bad", ["arms: [", "model: {name: x, source: y}\narms:\n  - {name: a, weight: -1}\n"]
)
def test_invalid_file_keeps_last_good_config(live, restore_config, bad):
    good_revision = live.revision()
    invalid_before = live.metric("specserve_config_reloads_total", result="invalid")
    live.write_config(bad, expect_applied=False)

    assert live.metric("specserve_config_reloads_total", result="invalid") == invalid_before + 1
    assert live.metric("specserve_config_last_reload_successful") == 0
    assert live.metric("specserve_config_info", revision=good_revision) == 1
    response = live.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    )
    assert response.status_code == 200
    assert response.headers[headers.CONFIG_REVISION] == good_revision


def test_ready_reports_an_arm_that_is_configured_but_not_deployed(live, restore_config):
    from tests.conftest import render_config

    ghost = render_config() + "  - {name: ghost, weight: 1}\n"
    revision = live.write_config(ghost)
    ready = live.http.get("/ready")
    assert ready.status_code == 503
    assert ready.json() == {
        "ready": False,
        "revision": revision,
        "waiting": {"ghost": "NOT_DEPLOYED"},
    }
    response = live.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={headers.ARM_OVERRIDE: "ghost"},
    )
    assert response.status_code == 503
    assert "not deployed" in response.json()["error"]["message"]
    # The deployed arms keep serving meanwhile.
    response = live.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={headers.ARM_OVERRIDE: "ngram"},
    )
    assert response.status_code == 200
