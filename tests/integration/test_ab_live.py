"""`specserve ab report` on a live split read from a real Prometheus: sticky traffic split by
weight between `no-spec` and an arm made deliberately worse (a drafter that does not match the
target, so every draft is wasted work) gets that arm a "roll back" verdict with the reason, its
true acceptance length, and a traffic share matching its weight. (Two identical arms reaching no
verdict, over many repeated experiments, is measured in tests/unit/test_ab.py.)"""

import concurrent.futures as cf
import json
import subprocess
import sys
import time
import uuid

import pytest

from specserve import headers
from specserve.config import load_config
from specserve.metrics import REQUEST_OUTPUT_SPEED
from tests.conftest import MISMATCHED, MISMATCHED_ARM, MODEL, render_config

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
REQUESTS = 72
TOPICS = ("the moon", "rivers", "bread", "a lighthouse", "winter", "bees", "trains", "chess")


def stream_once(live, topic: str) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a short story about {topic}."}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }
    session = {"x-session-id": uuid.uuid4().hex}  # a new user each time: split by weight
    with live.http.stream("POST", CHAT, json=body, headers=session) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            pass
        return response.headers[headers.ARM]


def exported_requests(prometheus, arm: str) -> float:
    query = f'sum(ray_{REQUEST_OUTPUT_SPEED}_count{{arm="{arm}"}})'
    found = prometheus.query(query)
    return float(found[0]["value"][1]) if found else 0.0


def test_the_report_rolls_back_a_worse_arm(live, prometheus, mismatched_drafter, tmp_path):
    original = live.config_path.read_text()
    split = render_config(no_spec_weight=1, ngram_weight=0)
    split += MISMATCHED_ARM.format(drafter=mismatched_drafter)
    try:
        live.write_config(split)
        live.platform.deploy(load_config(live.config_path))  # what `specserve serve` does
        live.platform.wait_until_running(timeout_s=420)
        # Counters start at an arm's first request: one request each before the experiment's
        # traffic, so that Prometheus counts every one of those from a known value.
        for arm in ("no-spec", MISMATCHED):
            forced = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            response = live.http.post(CHAT, json=forced, headers={headers.ARM_OVERRIDE: arm})
            assert response.status_code == 200
        deadline = time.monotonic() + 30
        while min(exported_requests(prometheus, a) for a in ("no-spec", MISMATCHED)) < 1:
            assert time.monotonic() < deadline, "Prometheus did not scrape the first requests"
            time.sleep(0.5)
        since = time.time()
        time.sleep(1.5)  # a scrape falls between the start and the first experiment request

        with cf.ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda i: stream_once(live, TOPICS[i % 8]), range(REQUESTS)))
        counts = {arm: served.count(arm) for arm in set(served)}
        assert set(counts) == {"no-spec", MISMATCHED}, counts
        time.sleep(4)  # Ray's export interval, then a scrape

        out = tmp_path / "report.json"
        command = [sys.executable, "-m", "specserve.cli", "ab", "report"]
        command += ["--prometheus", prometheus.url, "--since", str(since), "--json", str(out)]
        command += ["--min-requests", "20"]
        run = subprocess.run(command, capture_output=True, text=True, timeout=60)
        print(run.stdout, run.stderr)
        assert run.returncode == 0, run.stderr
        report = json.loads(out.read_text())
    finally:
        live.write_config(original)
        live.platform.deploy(load_config(live.config_path))
        live.platform.wait_until_running(timeout_s=300)

    rows = {row["arm"]: row for row in report["arms"]}
    assert report["baseline"] == "no-spec" and set(rows) >= {"no-spec", MISMATCHED}
    worse = rows[MISMATCHED]
    # Every request of the experiment counted, in the arm that served it.
    for arm, count in counts.items():
        assert rows[arm]["requests"] == pytest.approx(count, rel=0.06), (arm, counts)
    assert worse["traffic"]["expected"] == 0.5 and not worse["traffic"]["mismatch"]
    assert worse["verdict"] == "roll back", worse["reason"]
    assert worse["reason"].startswith("slower: tokens/s per user -")
    assert worse["tokens_per_s"]["difference"]["high"] < 0
    assert worse["tpot_s"]["difference"]["low"] > 0  # each token takes longer
    assert worse["acceptance_length"]["mean"] < 1.1  # the drafts are wrong
    assert worse["suggested_k"]["k"] == 0  # speculation does not pay
    assert rows["no-spec"]["acceptance_length"]["mean"] == 1.0
    assert f"{MISMATCHED}: roll back: slower" in run.stdout
