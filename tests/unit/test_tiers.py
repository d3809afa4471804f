"""The suite's tiers (tests/tiers.py): unit tests stay in process, and the budgets add up to
`make test`'s."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest

from tests import tiers


def test_a_unit_test_that_starts_ray_or_python_fails_and_tools_still_run():
    import ray

    with tiers._in_process():
        with pytest.raises(tiers.TierError, match="may not start Ray"):
            ray.init(address="local")
        with pytest.raises(tiers.TierError, match="Python process"):
            subprocess.run([sys.executable, "-c", "pass"])
        with pytest.raises(tiers.TierError, match="Python process"):
            subprocess.run("torchrun --nproc-per-node 2 train.py", shell=False)
        with pytest.raises(tiers.TierError, match="Python process"):
            multiprocessing.get_context("spawn").Process(target=print).start()
        assert subprocess.run(["true"]).returncode == 0  # helm, promtool, hadolint: allowed


def test_this_test_is_a_unit_test(request):
    assert tiers.tier_of(request.node) == tiers.UNIT
    assert request.node.get_closest_marker(tiers.UNIT)


def test_the_tier_is_the_first_marker_in_order_and_own_cluster_is_ray():
    class Item:
        def __init__(self, *markers: str) -> None:
            self.markers = markers

        def get_closest_marker(self, name: str):
            return name if name in self.markers else None

    assert tiers.tier_of(Item()) == tiers.UNIT
    assert tiers.tier_of(Item("own_cluster")) == tiers.RAY
    assert tiers.tier_of(Item("own_cluster", "e2e")) == tiers.E2E
    assert tiers.tier_of(Item("live", "disruptive")) == tiers.DISRUPTIVE
    assert tiers.tier_of(Item("long", "e2e", "live")) == tiers.LONG


def test_a_tier_over_its_budget_is_reported_and_the_cluster_run_has_its_own():
    run = tiers.Run()
    run.tiers = {"a": tiers.UNIT, "b": tiers.UNIT, "c": tiers.LIVE}
    run.durations.update({"a": 70.0, "b": 60.0, "c": 10.0})
    assert run.over_budget() == [
        f"tier unit: 130 s, over its budget of {tiers.BUDGETS_S[tiers.UNIT]} s"
    ]
    cluster = tiers.Run()
    cluster.tiers = {"tests/cluster/test_x.py::t": tiers.E2E}
    cluster.durations["tests/cluster/test_x.py::t"] = 1.0
    assert cluster.budget(tiers.E2E) == tiers.CLUSTER_BUDGET_S
    long = tiers.Run()
    long.tiers = {"l": tiers.LONG}
    long.durations["l"] = tiers.LONG_BUDGET_S - 1.0
    assert long.over_budget() == []  # `make test-long`: a budget of its own


def test_a_machine_without_bf16_has_larger_budgets(monkeypatch):
    from specserve import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    assert tiers.machine_scale() == tiers.FLOAT32_SCALE
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert tiers.machine_scale() == 1.0
    slow = tiers.Run(tiers.FLOAT32_SCALE)
    slow.tiers = {"a": tiers.UNIT}
    slow.durations["a"] = tiers.BUDGETS_S[tiers.UNIT] * 1.5  # over 1x, under 1.8x
    assert slow.over_budget() == []
    assert slow.budget(tiers.E2E) == tiers.BUDGETS_S[tiers.E2E] * tiers.FLOAT32_SCALE


def test_the_budgets_fit_make_tests_total():
    assert sum(tiers.BUDGETS_S.values()) + tiers.CLUSTER_BUDGET_S <= tiers.TOTAL_BUDGET_S
