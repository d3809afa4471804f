"""`specserve bench`'s statistics and reports, on figures with known answers."""

import math

import numpy as np

from specserve.bench.serving import (
    Cell,
    acceptance_between,
    compare,
    markdown,
    speedup_by_round,
    speedup_ci,
    split_rounds,
    summarize,
)


def test_speedup_is_the_ratio_of_means_and_its_interval_covers_it():
    rng = np.random.default_rng(1)
    base = list(rng.normal(20, 2, 64))
    arm = [x * 1.5 for x in base]  # every prompt exactly 1.5x faster
    ratio, low, high = speedup_ci(arm, base)
    assert math.isclose(ratio, 1.5)
    assert math.isclose(low, 1.5) and math.isclose(high, 1.5)  # paired: no spread at all

    noisy = list(np.array(base) * rng.normal(1.2, 0.2, 64))
    ratio, low, high = speedup_ci(noisy, base)
    assert low < ratio < high
    assert low > 1.0 and high < 1.4


def test_rounds_that_ran_apart_widen_the_interval_to_cover_them():
    """Two rounds, the arm 1.2x in one and 0.8x in the other: over prompts alone the interval
    is tight around 1.0 as if 64 prompts had each been drawn anew; over rounds it spans both."""
    rng = np.random.default_rng(2)
    base = list(rng.normal(20, 1, 64))
    shift = np.repeat([1.2, 0.8], 32) * rng.normal(1.0, 0.02, 64)
    arm = list(np.array(base) * shift)
    _, low, high = speedup_ci(arm, base)
    assert low > 0.95 and high < 1.05
    ratio, low, high = speedup_ci(arm, base, [32, 32])
    assert low < 0.85 and high > 1.15 and low < ratio < high
    # Rounds that agree leave the interval as narrow as the prompts make it.
    steady = list(np.array(base) * rng.normal(1.1, 0.02, 64))
    _, low, high = speedup_ci(steady, base, [16, 16, 16, 16])
    assert 1.08 < low < high < 1.12


def test_a_failed_prompt_leaves_its_round_in_the_interval():
    base = [10.0] * 6
    arm = [12.0, math.nan, 12.0, 8.0, 8.0, 8.0]
    ratio, low, high = speedup_ci(arm, base, [3, 3])
    assert math.isclose(ratio, 48.0 / 50.0)  # the failed prompt out of both arms' means
    assert math.isclose(low, 0.8) and math.isclose(high, 1.2)  # either round alone, at worst


def test_a_failed_request_drops_that_prompt_from_both_arms():
    ratio, _, _ = speedup_ci([2.0, math.nan, 4.0], [1.0, 100.0, 2.0])
    assert math.isclose(ratio, 2.0)
    assert all(math.isnan(x) for x in speedup_ci([math.nan], [1.0]))


def test_acceptance_between_two_reads_of_the_counters():
    before = {"eagle3": {"drafts": 10, "accepted": 5, "position_0": 4, "position_1": 1}}
    after = {
        "eagle3": {
            "drafts": 110,
            "accepted": 205,
            "position_0": 94,
            "position_1": 66,
            "position_2": 45,
        }
    }
    acc = acceptance_between(before, after, "eagle3")
    assert math.isclose(acc["mean_acceptance_length"], 3.0)
    assert acc["accepted_per_position"] == [0.9, 0.65, 0.45]
    assert acceptance_between(before, after, "no-spec") == {}


def test_the_k_in_force_counts_every_step_drafting_or_not():
    # 100 steps drafted 3 tokens and accepted 100 in all; 50 more steps drafted nothing (k = 0
    # under load): 250 tokens in 150 steps, 300 draft tokens -> 2 draft tokens per step.
    before = {"e": {"drafts": 0, "accepted": 0, "draft_tokens": 0, "output_tokens": 0}}
    after = {"e": {"drafts": 100, "accepted": 100, "draft_tokens": 300, "output_tokens": 250}}
    assert acceptance_between(before, after, "e")["k_in_force"] == 2.0
    plain = {"no-spec": {"output_tokens": 80}}
    assert acceptance_between({}, plain, "no-spec") == {"k_in_force": 0.0}


def test_summary_rows_and_comparison():
    base = Cell(
        "no-spec",
        4,
        tokens_per_s=[10.0, 10.0],
        ttft_s=[0.1, 0.1],
        tpot_s=[0.1, 0.1],
        latency_s=[1.0, 1.0],
    )
    fast = Cell(
        "eagle3",
        4,
        tokens_per_s=[15.0, math.nan],
        ttft_s=[0.1],
        tpot_s=[0.06],
        latency_s=[0.7],
        failed=1,
    )
    rows = summarize({4: {"no-spec": base, "eagle3": fast}}, "no-spec")
    row = next(r for r in rows if r["arm"] == "eagle3")
    assert row["requests"] == 1 and row["failed"] == 1
    assert math.isclose(row["speedup"], 1.5) and math.isclose(row["tokens_per_s_mean"], 15.0)
    earlier = {"rows": [{**row, "tokens_per_s_mean": 12.0, "speedup": 1.2}]}
    table = compare(rows, earlier)
    assert "+25.0%" in table and "1.50x (1.20x)" in table and "(new)" in table


def test_each_rounds_speedup_is_reported_beside_the_runs():
    """A round whose burst stalled one arm shows in its own ratio, and the table gives the
    rounds' spread beside the interval over prompts."""
    base = Cell("no-spec", 2, tokens_per_s=[10.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    arm = Cell("eagle3", 2, tokens_per_s=[10.0, 10.0, 6.0, math.nan, 11.0, 11.0])
    base.round_sizes = arm.round_sizes = [2, 2, 2]
    ratios = speedup_by_round(arm, base)
    assert [round(x, 6) for x in ratios] == [1.0, 0.6, 1.1]  # the failed prompt left out
    rows = summarize({2: {"no-spec": base, "eagle3": arm}}, "no-spec")
    row = next(r for r in rows if r["arm"] == "eagle3")
    assert row["speedup_rounds"] == ratios
    assert "| 0.60-1.10 |" in markdown(rows, "no-spec")


def test_every_round_holds_at_least_the_levels_concurrency():
    chats = list(range(24))
    assert [len(r) for r in split_rounds(chats, 4, 1)] == [6, 6, 6, 6]
    assert [len(r) for r in split_rounds(chats, 4, 8)] == [8, 8, 8]
    assert [len(r) for r in split_rounds(chats, 4, 16)] == [24]
    assert sorted(x for r in split_rounds(chats, 4, 8) for x in r) == chats


def test_a_platform_that_is_not_there_or_not_specserve_gets_one_clear_line():
    """What a new user sees running `specserve bench` before `specserve serve`, while it starts
    or against another server: a line saying so, not a traceback."""
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest

    from specserve.bench.serving import discover

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(SystemExit, match=rf"cannot reach specserve at .*:{port} .*specserve serve"):
        discover(f"http://127.0.0.1:{port}")

    answers = {"/v1/models": (503, {"error": "starting"})}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            status, body = answers.get(self.path, (404, {}))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(SystemExit, match="/v1/models answered 503 .*still starting"):
            discover(url)
        # Another OpenAI-compatible server: models, but no arms in its OpenAPI document.
        answers["/v1/models"] = (200, {"data": [{"id": "m"}]})
        answers["/openapi.json"] = (200, {"paths": {}})
        with pytest.raises(SystemExit, match="does not describe specserve's arms"):
            discover(url)
    finally:
        server.shutdown()
        server.server_close()
