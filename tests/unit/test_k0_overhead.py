"""bench/k0_overhead: the arm is set to draft nothing, and the difference per part cancels the
drift of a pass's second run when passes alternate which engine runs first."""

import pytest

from specserve.bench import k0_overhead


def test_the_arm_drafts_nothing_at_any_batch_size_and_keeps_the_rest_of_its_config():
    spec = {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 32, 1]],
    }
    config = k0_overhead.never_drafting(spec, 16)
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 16, 0]]
    assert config["method"] == "eagle3" and config["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 32, 1]]


def test_a_second_runs_drift_cancels_when_the_order_alternates():
    true_cost, drift = 0.3, 1.0  # ms per step: the arm's own cost, and running second
    arm, base = [], []
    for n in range(4):
        arm_second = n % 2 == 0  # the baseline runs first in even passes
        arm.append({"step": 50 + true_cost + (drift if arm_second else 0)})
        base.append({"step": 50 + (0 if arm_second else drift)})
    assert k0_overhead.balanced_differences(arm, base)["step"] == pytest.approx(true_cost)
    naive = sum(a["step"] for a in arm[::2]) / 2 - sum(b["step"] for b in base[::2]) / 2
    assert naive == pytest.approx(true_cost + drift)  # one order only: the drift stays in


def test_runs_must_pair_up():
    with pytest.raises(ValueError, match="one run of each engine per pass"):
        k0_overhead.balanced_differences([{"step": 1.0}], [])
