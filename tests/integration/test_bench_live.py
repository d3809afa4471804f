"""`specserve bench` against the live platform: vLLM's serving benchmark drives every arm on the
same prompts, and the reports (JSON, markdown, plots, comparison) come out of real requests."""

import argparse
import json

import pytest

from specserve.bench import serving
from tests.conftest import ADMIN_KEY


def bench_args(live, out, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(
        [
            *("--url", live.base_url, "--metrics-url", live.metrics_url),
            *("--api-key", ADMIN_KEY),
            *("--prompts", "chat", "--num-prompts", "4", "--concurrency", "1", "2"),
            *("--max-tokens", "8", "--rounds", "2", "--warmups", "1", "--out", str(out)),
            *extra,
        ]
    )


def test_bench_measures_every_arm_side_by_side(live, tmp_path, capsys):
    assert serving.run(bench_args(live, tmp_path)) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["arm"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(arm, c) for arm in ("no-spec", "ngram") for c in (1, 2)}
    for row in rows.values():
        assert row["requests"] == 4 and row["failed"] == 0
        assert row["tokens_per_s_mean"] > 0 and row["ttft_ms_p50"] > 0
        assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
    assert rows[("no-spec", 1)]["speedup"] == 1.0
    assert "mean_acceptance_length" not in rows[("no-spec", 1)]  # no drafts, no figure
    if "mean_acceptance_length" in rows[("ngram", 1)]:  # ngram drafts only on repeats
        assert 1.0 <= rows[("ngram", 1)]["mean_acceptance_length"] <= 4.0
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert "| ngram | 2 |" in (tmp_path / "results.md").read_text()

    again = tmp_path / "again"
    # One round, no warm-up: what is checked is the comparison printed, not the figures.
    once = ("--concurrency", "1", "--num-prompts", "2", "--rounds", "1", "--warmups", "0")
    args = bench_args(live, again, *once, "--compare", str(tmp_path / "results.json"))
    assert serving.run(args) == 0
    assert "tok/s per user now (then)" in capsys.readouterr().out


def overlap(a: list, b: list) -> bool:
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


def test_bench_together_serves_the_arms_at_the_same_time(live, tmp_path):
    """In turn, one arm's blocks never overlap another's; with --together every round's blocks
    start at the same moment after every arm's warm-up, and each arm is still scored on every
    prompt (the load schedule: tests/unit/test_bench_together.py)."""
    windows = {}
    for mode in ("turns", "together"):
        extra = ("--concurrency", "1", "--num-prompts", "2", "--warmups", "1")
        out = tmp_path / mode
        args = bench_args(live, out, *extra, *(("--together",) if mode == "together" else ()))
        assert serving.run(args) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["together"] is (mode == "together")
        assert {(r["arm"], r["requests"], r["failed"]) for r in results["rows"]} == {
            ("no-spec", 2, 0),
            ("ngram", 2, 0),
        }
        windows[mode] = {
            arm: results["requests"][f"1/{arm}"]["windows"] for arm in ("no-spec", "ngram")
        }
    assert not overlap(windows["turns"]["no-spec"], windows["turns"]["ngram"])
    together = windows["together"]
    for a, b in zip(together["no-spec"], together["ngram"], strict=True):
        assert abs(a[0] - b[0]) < 0.1  # the same start, whatever each arm's warm-up took


def test_bench_refuses_an_arm_that_is_not_configured(live, tmp_path):
    with pytest.raises(SystemExit, match="unknown arms"):
        serving.run(bench_args(live, tmp_path, "--arms", "no-spec", "eagle9"))
