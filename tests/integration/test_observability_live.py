"""The Grafana dashboards and the alert rules against a real Prometheus scraping a running
specserve with traffic on every arm: every dashboard query returns data for the arms it shows,
the revision annotation marks a config change, and every alert rule evaluates on the real series
(two of them are driven into pending by real faults)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from grafana import dashboards, promql
from specserve import headers
from tests.conftest import MODEL, render_config

ARMS = {"no-spec", "ngram"}  # the test platform's arms (tests/conftest.py)
SPECULATIVE = {"ngram"}
GHOST = "ghost"  # configured, never deployed: its weighted share falls back
COPY_TASK = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta " * 6}]


def _load(client: httpx.Client, arm: str, stop: threading.Event) -> None:
    """Keep one arm busy: streaming chats (TTFT, TPOT, acceptance) and plain completions."""
    while not stop.is_set():
        client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": COPY_TASK, "max_tokens": 24, "stream": True},
            headers={headers.ARM_OVERRIDE: arm},
        )
        client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "The colours of the rainbow are", "max_tokens": 16},
            headers={headers.ARM_OVERRIDE: arm},
        )


def _wait_for_alert(prometheus, name: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        alerts = httpx.get(f"{prometheus.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        found = [a for a in alerts if a["labels"]["alertname"] == name]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{name} never became pending"
        time.sleep(1)


@pytest.fixture(scope="module")
def traffic(live, prometheus):
    """Traffic on every arm for the whole module, a rejected config file, an arm that is
    configured but not running (its share falls back), a client error per arm."""
    original = live.config_path.read_text()
    stop = threading.Event()
    clients = [httpx.Client(base_url=live.base_url, timeout=120, headers=live.auth) for _ in ARMS]
    threads = [
        threading.Thread(target=_load, args=(client, arm, stop), daemon=True)
        for client, arm in zip(clients, sorted(ARMS), strict=True)
    ]
    for thread in threads:
        thread.start()
    alerts = {}
    try:
        for arm in ARMS:
            too_long = {"model": MODEL, "prompt": "Hi", "max_tokens": 10**6}
            response = live.http.post(
                "/v1/completions", json=too_long, headers={headers.ARM_OVERRIDE: arm}
            )
            assert response.status_code == 400
        live.write_config("arms: [", expect_applied=False)
        alerts["reload"] = _wait_for_alert(prometheus, "SpecserveConfigReloadFailing")
        live.write_config(render_config() + f"  - {{name: {GHOST}, weight: 2}}\n")

        def by_weight(i: int) -> int:
            response = live.http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                headers={"x-session-id": f"fallback-{i}"},
            )
            return response.status_code

        # At once: one after the other, each waited behind the load's streams.
        with cf.ThreadPoolExecutor(12) as pool:
            assert set(pool.map(by_weight, range(12))) == {200}
        alerts["not_running"] = _wait_for_alert(prometheus, "SpecserveArmNotRunning")
        live.write_config(original)
        yield alerts
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
        for client in clients:
            client.close()
        if live.config_path.read_text() != original:
            live.write_config(original)


def test_faults_drive_their_alerts_on_real_series(traffic):
    reload, not_running = traffic["reload"], traffic["not_running"]
    assert reload["state"] == "pending" and reload["labels"]["model"] == MODEL
    assert not_running["state"] == "pending" and not_running["labels"]["arm"] == GHOST
    assert "docs/runbook.md#" in not_running["annotations"]["runbook_url"]


def test_every_alert_rule_evaluates_without_error(prometheus, traffic):
    rules = prometheus.rules()
    assert len(rules) >= 6
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_every_dashboard_query_returns_data_for_its_arms(prometheus, traffic):
    queries = list(dashboards.expressions())
    assert len(queries) >= 20
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 120
    pending = queries
    while pending:
        missing = {}
        for title, expr in pending:
            query = promql.resolve(expr)
            if "(annotation)" in title:
                # Marks a revision for a moment after it appears: look over the last minutes.
                found = prometheus.query_range(query, seconds=600)
                arms_seen, expected = set(), set()
            else:
                found = prometheus.query(query)
                arms_seen = {s["metric"]["arm"] for s in found if "arm" in s["metric"]}
                expected = _arms_expected(expr) if arms_seen else set()
            if not found or not expected <= arms_seen:
                missing[title] = f"{query} -> arms {sorted(arms_seen)}, want {sorted(expected)}"
        pending = [(t, e) for t, e in pending if t in missing]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert not missing, "\n".join(f"{t}: {m}" for t, m in missing.items())


def _arms_expected(expr: str) -> set[str]:
    """The arms a per-arm query must show: drafting figures exist for speculative arms only,
    fallbacks for the arm that was not running, everything else for every arm."""
    if "spec_" in expr:
        return SPECULATIVE
    if "routing_fallbacks" in expr:
        return {GHOST}
    return ARMS
