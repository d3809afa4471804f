"""Per-arm metrics from real requests, and a real Prometheus scraping them."""

import time

from specserve import headers
from tests.conftest import MODEL

REPETITIVE = {
    "model": MODEL,
    "messages": [
        {
            "role": "user",
            "content": "Copy this list exactly, twice:\n"
            + "\n".join(f"- item {i}: alpha beta gamma delta" for i in range(8)),
        }
    ],
    "max_tokens": 64,  # the list's first copy and more: n-gram drafts from the prompt
    "temperature": 0,
}


def test_acceptance_counted_on_ngram_arm_only(live):
    before = {
        arm: live.metric("specserve_spec_accepted_tokens_total", arm=arm)
        for arm in ("ngram", "no-spec")
    }
    drafts_before = live.metric("specserve_spec_drafts_total", arm="ngram")
    ok_before = live.metric("specserve_requests_total", arm="ngram", outcome="ok")
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
    live.wait_for_metric("specserve_requests_total", ok_before + 2, arm="ngram", outcome="ok")
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
    assert live.metric("specserve_arm_weight", arm="ngram", model=MODEL) == 1
    assert live.metric("specserve_arm_running", arm="ngram", model=MODEL) == 1


def test_real_prometheus_computes_acceptance_per_arm(live, prometheus):
    r = live.http.post(
        "/v1/chat/completions", json=REPETITIVE, headers={headers.ARM_OVERRIDE: "ngram"}
    )
    assert r.status_code == 200
    # Mean acceptance length over everything counted so far, in PromQL (docs/metrics.md).
    query = (
        "1 + sum by (arm) (ray_specserve_spec_accepted_tokens_total)"
        " / sum by (arm) (ray_specserve_spec_drafts_total)"
    )
    deadline = time.monotonic() + 60
    while not (result := prometheus.query(query)):
        assert time.monotonic() < deadline, "Prometheus never scraped the router's metrics"
        time.sleep(1)
    by_arm = {s["metric"]["arm"]: float(s["value"][1]) for s in result}
    assert by_arm["ngram"] > 1.0
    assert "no-spec" not in by_arm  # no drafts, no acceptance length


def test_the_local_clusters_serve_processes_run_at_a_laptops_pace(live):
    """`specserve serve`'s local cluster hands LOCAL_SERVE_ENV to every Ray process: the Serve
    controller's loop and each replica's metrics export run at its pace (deploy.py), where Ray's
    defaults kept an idle platform's processes busier (BENCHMARKS.md)."""
    import psutil

    from specserve.deploy import LOCAL_SERVE_ENV

    titles = ("ray::ServeController", "ray::ServeReplica:specserve:router")
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or ())
        for wanted in titles:
            if title.startswith(wanted):
                found[wanted] = process.environ()
    assert set(found) == set(titles), sorted(found)
    for title, environ in found.items():
        assert {k: environ.get(k) for k in LOCAL_SERVE_ENV} == LOCAL_SERVE_ENV, title
