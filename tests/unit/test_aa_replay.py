"""bench.aa_replay's reading of a look: the report's verdict, or the interval over groups of
units alone, behind the same gates."""

import numpy as np

from specserve.ab.report import Options, compare
from specserve.bench.aa_replay import called, units_alone
from tests.unit.test_ab import windowed_arm


def test_a_drift_both_arms_share_is_a_difference_over_units_alone_and_none_over_windows():
    """Two identical arms on one core: five windows one way, three the other, every user
    alike. Over groups of units the 15 % the drift left between the arms' means is a
    difference; over windows of time it is none. Too few requests: neither calls it."""
    drift = [0.15] * 5 + [-0.05] * 3
    arms = {
        "a": windowed_arm(1, 30, drift, seed=1),
        "b": windowed_arm(1, 30, [-d for d in drift], seed=2),
    }
    # As the replay reads each: the units' totals in one window (the counters' whole growth).
    units = units_alone(arms)
    options = Options(baseline="b")
    row = compare(arms, {}, {}, options)["arms"][1]
    assert row["tokens_per_s"]["difference"]["relative"] > 0.1
    assert not called(row, "two_way", options)
    assert called(compare(units, {}, {}, options)["arms"][1], "units", options)
    strict = Options(baseline="b", min_requests=int(np.ceil(row["requests"])) + 1)
    assert not called(compare(units, {}, {}, strict)["arms"][1], "units", strict)
