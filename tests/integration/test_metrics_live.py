"""Per-arm metrics from real requests, and a real Prometheus scraping them."""

import os
import shutil
import subprocess
import time

import httpx
import pytest

from specserve import headers
from tests.conftest import MODEL, free_port

pytestmark = pytest.mark.slow

REPETITIVE = {
    "model": MODEL,
    "messages": [
        {
            "role": "user",
            "content": "Copy this list exactly, twice:\n"
            + "\n".join(f"- item {i}: alpha beta gamma delta" for i in range(8)),
        }
    ],
    "max_tokens": 120,
    "temperature": 0,
}


def test_acceptance_counted_on_ngram_arm_only(live):
    before = {
        arm: live.metric("specserve_spec_accepted_tokens_total", arm=arm)
        for arm in ("ngram", "no-spec")
    }
    drafts_before = live.metric("specserve_spec_drafts_total", arm="ngram")
    for stream in (False, True):
        body = dict(REPETITIVE, stream=stream)
        r = live.http.post(
            "/v1/chat/completions", json=body, headers={headers.ARM_OVERRIDE: "ngram"}
        )
        assert r.status_code == 200
        r = live.http.post(
            "/v1/chat/completions", json=body, headers={headers.ARM_OVERRIDE: "no-spec"}
        )
        assert r.status_code == 200
    accepted = live.metric("specserve_spec_accepted_tokens_total", arm="ngram") - before["ngram"]
    drafts = live.metric("specserve_spec_drafts_total", arm="ngram") - drafts_before
    assert accepted > 0 and drafts > 0
    assert 1 + accepted / drafts > 1.3, "a copy task should accept many n-gram drafts"
    assert live.metric("specserve_spec_accepted_tokens_total", arm="no-spec") == before["no-spec"]
    positions = [
        live.metric(
            "specserve_spec_accepted_tokens_per_position_total", arm="ngram", position=str(p)
        )
        for p in range(3)
    ]
    assert positions[0] >= positions[1] >= positions[2] and positions[0] > 0
    assert live.metric("specserve_time_to_first_token_seconds_count", arm="ngram") > 0
    assert live.metric("specserve_output_tokens_total", arm="no-spec") > 0
    assert live.metric("specserve_requests_total", arm="ngram", outcome="ok") >= 2
    assert live.metric("specserve_arm_weight", arm="ngram") == 1


def test_real_prometheus_computes_acceptance_per_arm(live, tmp_path):
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs Debian's prometheus; it is missing")
        pytest.skip("prometheus server not installed (apt-get install prometheus)")
    r = live.http.post(
        "/v1/chat/completions", json=REPETITIVE, headers={headers.ARM_OVERRIDE: "ngram"}
    )
    assert r.status_code == 200
    target = live.metrics_url.removeprefix("http://").removesuffix("/metrics")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Mean acceptance length over everything counted so far, in PromQL (docs/metrics.md).
        query = (
            "1 + sum by (arm) (specserve_spec_accepted_tokens_total)"
            " / sum by (arm) (specserve_spec_drafts_total)"
        )
        deadline = time.monotonic() + 60
        result = []
        while time.monotonic() < deadline and not result:
            time.sleep(1)
            try:
                answer = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5
                ).json()
            except httpx.HTTPError:
                continue
            result = answer.get("data", {}).get("result", [])
        assert result, "Prometheus never scraped the router"
        by_arm = {s["metric"]["arm"]: float(s["value"][1]) for s in result}
        assert by_arm["ngram"] > 1.0
        assert "no-spec" not in by_arm  # no drafts, no acceptance length
    finally:
        proc.terminate()
        proc.wait(timeout=30)
