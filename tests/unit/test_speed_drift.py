"""The drift figures of bench/speed_drift.py on series whose drift is known."""

import numpy as np

from specserve.bench.ab_false_positives import engine_state
from specserve.bench.speed_drift import Sample, drift_figures, markdown


def samples(arm: str, speeds: np.ndarray, offset: float = 0.0) -> list[Sample]:
    return [Sample(offset + 2.0 * i, arm, float(s)) for i, s in enumerate(speeds)]


def test_independent_requests_show_no_drift_and_a_drifting_engine_does():
    rng = np.random.default_rng(0)
    steady = 20 + rng.standard_normal(400)
    drifting = 20 + engine_state(rng, 400, 0.9)
    # Interleaved in time as the router would send them; each arm is read in its own order.
    figures = drift_figures(samples("a", steady) + samples("b", drifting, offset=1.0))
    a, b = figures["a"], figures["b"]
    assert a["requests"] == b["requests"] == 400
    assert abs(a["autocorrelation"][1]) < 0.15
    assert 0.8 < b["autocorrelation"][1] < 0.95
    assert b["autocorrelation"][8] < b["autocorrelation"][1]
    assert 0.5 < a["variance_inflation"][10] < 1.6
    # An AR(1) at 0.9 inflates the mean's variance ~(1 + 0.9) / (1 - 0.9) = 19 for long blocks.
    assert b["variance_inflation"][20] > 5
    table = markdown(figures)
    assert table.count("\n| ") == 3 and "| b | 400 |" in table


def test_the_arms_own_order_is_by_start_time_not_by_arrival_in_the_list():
    speeds = np.arange(30, dtype=float)  # a steady climb: strongly autocorrelated in order
    shuffled = samples("a", speeds)
    np.random.default_rng(1).shuffle(shuffled)
    assert drift_figures(shuffled)["a"]["autocorrelation"][1] > 0.8
