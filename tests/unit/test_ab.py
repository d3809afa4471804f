"""The A/B report's statistics and verdicts on known inputs (the live report against a real
Prometheus is tests/integration/test_mismatched_arm_live.py)."""

import math

import numpy as np
import pytest

from specserve.ab.prometheus import ArmTotals, parse_since
from specserve.ab.report import (
    KEEP_TESTING,
    MIN_WINDOWS,
    PROMOTE,
    ROLL_BACK,
    UNIT_MIXED,
    UNIT_REQUEST,
    UNIT_STICKY_KEY,
    Options,
    compare,
    render,
    speedup_by_load,
    suggest_k,
)
from specserve.ab.sequential import (
    Clustered,
    Moments,
    clustered_variance,
    difference,
    mixture_half_width,
)
from specserve.bench.ab_false_positives import simulate
from specserve.metrics import (
    REQUEST_ACCEPTANCE_LENGTH,
    REQUEST_OUTPUT_SPEED,
    TIME_PER_OUTPUT_TOKEN,
    UNIT_BUCKETS,
)


def moments(values) -> Moments:
    values = np.asarray(values, dtype=float)
    return Moments(len(values), float(values.sum()), float((values * values).sum()))


def test_moments_give_the_sample_mean_and_variance():
    values = [3.0, 5.0, 10.0, 2.0]
    got = moments(values)
    assert got.mean == pytest.approx(np.mean(values))
    assert got.variance == pytest.approx(np.var(values, ddof=1))
    assert math.isnan(Moments(1, 3, 9).variance)
    assert Moments.constant(1.0).variance_of_mean() == 0


def test_the_interval_narrows_as_requests_accumulate_and_is_wider_than_a_fixed_one():
    widths = [mixture_half_width(4.0 / n, tau=1.0, alpha=0.05) for n in (10, 100, 1000, 10000)]
    assert widths == sorted(widths, reverse=True)
    # At any one size it is wider than the fixed-sample 95% interval (1.96 standard errors):
    # the price of being valid at every look.
    assert widths[-1] > 1.96 * math.sqrt(4.0 / 10000)
    with pytest.raises(ValueError, match="alpha"):
        mixture_half_width(1.0, tau=1.0, alpha=1.5)


def test_a_difference_against_a_constant_uses_only_the_arms_own_spread():
    rng = np.random.default_rng(1)
    arm = moments(1.6 + 0.3 * rng.standard_normal(400))
    interval = difference(arm, Moments.constant(1.0), alpha=0.05, relative_tau=0.1)
    assert interval.estimate == pytest.approx(arm.mean - 1.0)
    assert interval.low > 0
    assert difference(Moments(1, 2, 4), Moments(1, 2, 4), alpha=0.05, relative_tau=0.1).low == (
        -math.inf
    )


def test_watching_identical_arms_stays_under_alpha_where_peeking_at_fixed_intervals_does_not():
    """Repeated experiments, read after every 10 requests: the always-valid interval's false
    positive rate stays at most alpha; the ordinary interval's does not (so the simulation can
    tell them apart); and a 10% slower arm is still found."""
    methods = ("always_valid", "fixed_sample")
    same = simulate(300, requests=1000, look_every=10, effect=0.0, seed=7, methods=methods)
    assert same["always_valid"]["detected"] <= 0.05
    assert same["fixed_sample"]["detected"] > 0.15
    slower = simulate(100, requests=1000, look_every=10, effect=0.1, seed=8, methods=methods)
    assert slower["always_valid"]["detected"] >= 0.9


def test_a_users_requests_are_one_unit_the_interval_over_groups_of_users_holds():
    """Sticky users who each send many requests at speeds of their own: taken as independent
    requests, identical arms differ "with confidence" in most experiments; over the groups of
    users, alone or with windows of time (what the report does), in at most alpha of them; a
    difference is still found where the requests are independent, and a large one where a few
    hundred users send them."""
    methods = ("always_valid", "clustered", "two_way")
    users = simulate(150, requests=600, look_every=30, effect=0.0, seed=1, users=20)
    assert users["always_valid"]["detected"] > 0.3
    assert users["clustered"]["detected"] <= 0.05 and users["two_way"]["detected"] <= 0.05
    independent = simulate(100, requests=1000, look_every=50, effect=0.1, seed=8, methods=methods)
    assert independent["clustered"]["detected"] >= 0.9
    assert independent["two_way"]["detected"] >= 0.8
    # Half as fast, 300 users (the busiest ~16 % of the traffic): found in most experiments, not
    # all: a few heavy users decide a mean, however many requests they send.
    slower = simulate(50, requests=2000, look_every=50, effect=0.5, seed=3, users=300)
    assert slower["clustered"]["detected"] >= 0.8 and slower["two_way"]["detected"] >= 0.7


def test_an_engine_state_that_drifts_between_requests_is_absorbed_by_windows_of_time():
    """Requests close in time share their engine's state (its batch, on a loaded node), and two
    engines on one core move against each other: over groups of units alone, identical arms then
    differ "with confidence" far more often than alpha at the loop's sizes (a few hundred
    requests, a look every ~15), as an A/A through the loop did. The report's interval, two-way
    over groups of units and windows of time shared by the arms, stays near alpha, and without
    drift under it."""
    sizes = dict(experiments=200, requests=200, look_every=15, effect=0.0, seed=5)
    steady = simulate(**sizes)
    drifting = simulate(**sizes, drift=0.25, drift_rho=0.9, drift_coupling=-0.75)
    assert steady["clustered"]["detected"] <= 0.05
    assert drifting["clustered"]["detected"] > 0.3
    assert steady["two_way"]["detected"] <= 0.05
    assert drifting["two_way"]["detected"] <= 0.09  # ~5 % over 1,000 experiments


def test_cluster_robust_variance_is_the_sandwich_and_one_request_per_group_is_the_usual_one():
    rng = np.random.default_rng(4)
    values = rng.lognormal(3, 0.5, 40)
    singletons = Clustered.of_groups((1.0, float(v)) for v in values)
    assert singletons.value() == pytest.approx(values.mean())
    assert singletons.variance_of_mean() == pytest.approx(moments(values).variance_of_mean())
    # Two groups of 20 alike requests each: two observations' worth of spread, not forty.
    groups = Clustered.of_groups(((20.0, 20 * 10.0), (20.0, 20 * 30.0)))
    assert groups.n == 40 and groups.value() == 20.0
    assert groups.variance_of_mean() == pytest.approx(2 / 1 * (100 * 20**2 * 2) / 40**2)
    assert math.isnan(Clustered.of_groups(((5.0, 50.0),)).variance_of_mean())


def clustered_arm(weight, groups, sticky=True):
    """An arm whose requests come from users in `groups`: {bucket: per-request speeds}, each
    group's requests dealt in turn to MIN_WINDOWS windows of time."""
    speeds = np.concatenate(list(groups.values()))
    totals = arm(weight, len(speeds), speeds)
    totals.sticky = len(speeds) if sticky else 0.0
    totals.clustered[REQUEST_OUTPUT_SPEED] = Clustered(
        tuple(
            (b, w, float(len(v[w::MIN_WINDOWS])), float(np.sum(v[w::MIN_WINDOWS])))
            for b, v in groups.items()
            for w in range(min(MIN_WINDOWS, len(v)))
        )
    )
    totals.selections_by_bucket = {b: float(len(v)) for b, v in groups.items()}
    return totals


def test_the_verdict_waits_for_enough_groups_of_users_and_a_heavy_user_is_no_mismatch():
    rng = np.random.default_rng(6)

    def users(buckets, mean, per_user):
        return {str(b): mean * rng.lognormal(0, 0.2, per_user) for b in buckets}

    # Three heavy users per arm, the challenger much faster: per request a sure promotion.
    base = clustered_arm(1, users((0, 1, 2), 30, 100))
    few = clustered_arm(1, users((3, 4, 5), 45, 100))
    report = compare({"base": base, "new": few}, {}, {}, Options(baseline="base"))
    row = report["arms"][1]
    assert report["unit"] == UNIT_STICKY_KEY and report["cluster_robust"]
    assert row["unit_groups"] == 3 and row["verdict"] == KEEP_TESTING
    assert f"3 of {UNIT_BUCKETS} groups" in row["reason"] and "too few users" in row["reason"]
    # Many users: the same difference is a promotion.
    many = {
        "base": clustered_arm(1, users(range(0, 32, 2), 30, 20)),
        "new": clustered_arm(1, users(range(1, 32, 2), 45, 20)),
    }
    row = compare(many, {}, {}, Options(baseline="base"))["arms"][1]
    assert row["verdict"] == PROMOTE and row["unit_groups"] == 16
    # One user sending half of one arm's requests moves the split far from the weights (a
    # request-level check would call it a mismatch) but not beyond what its groups explain.
    heavy = users(range(0, 32, 2), 30, 20)
    heavy["0"] = 30 * rng.lognormal(0, 0.2, 320)
    skewed = {"base": clustered_arm(1, heavy), "new": many["new"]}
    row = compare(skewed, {}, {}, Options(baseline="base"))["arms"][1]
    assert row["traffic"]["observed"] < 0.4 and not row["traffic"]["mismatch"]
    # A split off its weights in every group is one.
    lopsided = {
        "base": clustered_arm(1, {str(b): np.full(30, 30.0) for b in range(16)}),
        "new": clustered_arm(1, {str(b): np.full(10, 30.0) for b in range(16)}),
    }
    row = compare(lopsided, {}, {}, Options(baseline="base"))["arms"][1]
    assert row["traffic"]["mismatch"] and "weight share" in row["reason"]


def windowed_arm(weight, mean, drift, groups=16, seed=0):
    """An arm whose per-user speeds move by `drift[w]` (a share of `mean`) in window w: three
    requests per group of units and window, lightly spread around that."""
    rng = np.random.default_rng(seed)
    cells, speeds = [], []
    for window, shift in enumerate(drift):
        for group in range(groups):
            values = mean * (1 + shift) * rng.lognormal(0, 0.05, 3)
            cells.append((str(group), window, 3.0, float(values.sum())))
            speeds.extend(values)
    totals = arm(weight, len(speeds), np.array(speeds))
    totals.sticky = len(speeds)
    totals.clustered[REQUEST_OUTPUT_SPEED] = Clustered(tuple(cells))
    totals.selections_by_bucket = {str(g): 3.0 * len(drift) for g in range(groups)}
    return totals


def test_windows_of_time_are_shared_by_the_arms_and_counted_before_a_verdict():
    """Two engines on one core: when one is fast the other is slow. Taken window by window over
    both arms, the difference's variance is far above the arms' variances added (which would
    call a drift a difference); two arms that drift alike cancel out. And no verdict before the
    experiment spans MIN_WINDOWS windows, however large the difference."""
    drift = [0.2, -0.2] * 4
    fast = windowed_arm(1, 30, drift, seed=1)
    slow = windowed_arm(1, 30, [-d for d in drift], seed=2)
    alike = windowed_arm(1, 30, drift, seed=3)
    speed = REQUEST_OUTPUT_SPEED
    apart = fast.clustered[speed].variance_of_mean() + slow.clustered[speed].variance_of_mean()
    opposed = clustered_variance(((fast.clustered[speed], 1.0), (slow.clustered[speed], -1.0)))
    together = clustered_variance(((fast.clustered[speed], 1.0), (alike.clustered[speed], -1.0)))
    assert opposed > 1.8 * apart and together < 0.1 * apart
    # Each one-way variance alone (units: none of this drift; windows: all of it).
    groups = Clustered.of_groups(
        (c, t) for _, _, c, t in fast.clustered[speed].cells + slow.clustered[speed].cells
    )
    assert groups.variance_of_mean() < 0.1 * opposed

    # 45 against 30 per user, every user: promoted over eight windows, not over three.
    short = {
        "base": windowed_arm(1, 30, [0.0] * 3),
        "new": windowed_arm(1, 45, [0.0] * 3, seed=4),
    }
    row = compare(short, {}, {}, Options(baseline="base"))["arms"][1]
    assert row["windows"] == 3 and row["verdict"] == KEEP_TESTING
    assert f"3 windows of time, {MIN_WINDOWS} needed" in row["reason"]
    longer = {
        "base": windowed_arm(1, 30, [0.0] * 8),
        "new": windowed_arm(1, 45, [0.0] * 8, seed=4),
    }
    row = compare(longer, {}, {}, Options(baseline="base"))["arms"][1]
    assert row["windows"] == 8 and row["verdict"] == PROMOTE, row["reason"]


def test_an_arm_no_group_has_reached_yet_is_a_mismatch_only_past_what_chance_explains():
    """The loop's first reads: the challenger (a quarter of the weight) has not been chosen
    yet. No group shows spread; chance alone leaves it at 0 of 10 requests one time in 18,
    at 0 of 120 practically never."""
    speeds = np.full(1, 30.0)

    def split(requests: int) -> dict:
        others = clustered_arm(3, {str(b): speeds for b in range(requests)})
        return {"base": others, "new": ArmTotals(weight=1)}

    early = compare(split(10), {}, {}, Options(baseline="base"))["arms"][1]["traffic"]
    late = compare(split(120), {}, {}, Options(baseline="base"))["arms"][1]["traffic"]
    assert early == {"expected": 0.25, "observed": 0.0, "mismatch": False}
    assert late == {"expected": 0.25, "observed": 0.0, "mismatch": True}


def test_the_report_names_its_unit():
    speeds = {str(b): np.full(3, 30.0) for b in range(10)}
    sticky = {"a": clustered_arm(1, speeds), "b": clustered_arm(1, speeds)}
    unsticky = {"a": clustered_arm(1, speeds, sticky=False), "b": clustered_arm(1, speeds)}
    old = {"a": arm(1, 30, np.full(30, 30.0)), "b": arm(1, 30, np.full(30, 30.0))}
    old["a"].sticky = 30
    no_keys = {name: clustered_arm(1, speeds, sticky=False) for name in "ab"}
    for arms, unit, robust in (
        (sticky, UNIT_STICKY_KEY, True),
        (unsticky, UNIT_MIXED, True),
        (no_keys, UNIT_REQUEST, True),
        (old, UNIT_MIXED, False),
    ):
        report = compare(arms, {}, {}, Options(baseline="a"))
        assert (report["unit"], report["cluster_robust"]) == (unit, robust)
        shown = render(
            report
            | {"model": "m", "revision": "r", "since": 0, "now": 60, "alpha": 0.05}
            | {"baseline": "a", "window_s": 30}
        )
        assert f"unit: {unit} (" in shown
        assert ("cluster-robust" in shown) == robust


def arm(weight, randomized, speeds, tpots=None, lengths=None, drafts=0.0, positions=()):
    totals = ArmTotals(weight=weight, randomized=randomized, drafts=drafts)
    totals.stats[REQUEST_OUTPUT_SPEED] = moments(speeds)
    if tpots is not None:
        totals.stats[TIME_PER_OUTPUT_TOKEN] = moments(tpots)
    if lengths is not None:
        totals.stats[REQUEST_ACCEPTANCE_LENGTH] = moments(lengths)
    totals.accepted_per_position = list(positions)
    return totals


def test_verdicts_follow_the_primary_figure():
    rng = np.random.default_rng(2)

    def speeds(mean, n=400):
        return mean * rng.lognormal(0, 0.3, n)

    arms = {
        "no-spec": arm(1, 400, speeds(30), tpots=1 / speeds(30)),
        "fast": arm(
            1,
            400,
            speeds(40),
            lengths=1.8 + 0.2 * rng.random(400),
            drafts=900,
            positions=(600, 300, 100),
        ),
        "slow": arm(
            1,
            400,
            speeds(20),
            lengths=1.0 + 0.01 * rng.random(400),
            drafts=900,
            positions=(5, 1, 0),
        ),
        "same": arm(1, 400, speeds(30)),
        "new": arm(1, 400, speeds(40, n=10)),
    }
    report = compare(arms, {}, {}, Options(baseline="no-spec"))
    rows = {row["arm"]: row for row in report["arms"]}
    assert report["arms"][0]["arm"] == "no-spec" and "verdict" not in rows["no-spec"]
    assert rows["fast"]["verdict"] == PROMOTE and "faster" in rows["fast"]["reason"]
    assert rows["slow"]["verdict"] == ROLL_BACK and "slower" in rows["slow"]["reason"]
    assert rows["same"]["verdict"] == KEEP_TESTING
    assert rows["new"]["verdict"] == KEEP_TESTING and "30 needed" in rows["new"]["reason"]
    # No-spec makes exactly one token per step: the drafter arms' acceptance is against 1.
    assert rows["no-spec"]["acceptance_length"]["mean"] == 1.0
    assert rows["slow"]["acceptance_length"]["difference"]["high"] < 0.02
    assert rows["fast"]["acceptance_length"]["difference"]["low"] > 0.7
    assert rows["fast"]["tpot_s"] is None  # no streaming requests
    text = render(
        report
        | {
            "model": "m",
            "revision": "r",
            "since": 0,
            "now": 60,
            "alpha": 0.05,
            "baseline": "no-spec",
        }
    )
    assert "slow: roll back: slower" in text and "fast: promote" in text


def test_a_promotion_waits_while_one_keys_requests_lose_more_than_their_share():
    """Faster overall, carried by two keys; a third key's requests are 30 % slower on it."""
    rng = np.random.default_rng(5)

    def speeds(mean, n):
        return mean * rng.lognormal(0, 0.2, n)

    base_keys = {"a": speeds(30, 300), "b": speeds(30, 300), "c": speeds(30, 150)}
    new_keys = {"a": speeds(45, 300), "b": speeds(45, 300), "c": speeds(21, 150)}

    def with_keys(keys: dict) -> ArmTotals:
        totals = arm(1, 750, np.concatenate(list(keys.values())))
        totals.by_key = {key: moments(values) for key, values in keys.items()}
        return totals

    arms = {"no-spec": with_keys(base_keys), "new": with_keys(new_keys)}
    row = compare(arms, {}, {}, Options(baseline="no-spec"))["arms"][1]
    assert row["tokens_per_s"]["difference"]["low"] > 0  # faster overall, with confidence
    assert row["by_key"]["c"]["relative"] == pytest.approx(-0.3, abs=0.06)
    assert row["verdict"] == KEEP_TESTING and "key c's requests" in row["reason"]
    # A looser bound lets it through; so does a key segment too small to read.
    loose = compare(arms, {}, {}, Options(baseline="no-spec", max_key_loss=0.5))["arms"][1]
    assert loose["verdict"] == PROMOTE
    few = Options(baseline="no-spec", min_requests=200)
    assert compare(arms, {}, {}, few)["arms"][1]["verdict"] == PROMOTE


def test_a_split_that_does_not_follow_the_weights_is_flagged_and_blocks_a_verdict():
    rng = np.random.default_rng(3)
    arms = {
        "no-spec": arm(1, 700, 30 * rng.lognormal(0, 0.3, 700)),
        "b": arm(1, 300, 20 * rng.lognormal(0, 0.3, 300)),
    }
    rows = compare(arms, {}, {}, Options(baseline="no-spec"))["arms"]
    assert rows[1]["traffic"] == {"expected": 0.5, "observed": 0.3, "mismatch": True}
    assert rows[1]["verdict"] == KEEP_TESTING and "weight share" in rows[1]["reason"]


def test_the_suggested_k_maximizes_tokens_per_unit_of_cost():
    # Acceptance 0.6, 0.3, 0.05 at positions 0-2: tokens per step 1.6, 1.9, 1.95.
    totals = ArmTotals(drafts=100, accepted_per_position=[60, 30, 5])
    assert suggest_k(totals, draft_cost=0.1)["k"] == 2  # 1/1, 1.6/1.1, 1.9/1.2, 1.95/1.3
    assert suggest_k(totals, draft_cost=0.0)["k"] == 3
    assert suggest_k(totals, draft_cost=0.0)["try_larger"]
    # A drafter that is never right: speculation does not pay (its positions export nothing).
    assert suggest_k(ArmTotals(drafts=100), draft_cost=0.1)["k"] == 0
    assert suggest_k(ArmTotals(drafts=100, accepted_per_position=[5]), draft_cost=0.1)["k"] == 0
    assert suggest_k(ArmTotals(), draft_cost=0.1) is None


def test_speedup_is_taken_per_band_of_load():
    load = {0.0: 1.0, 60.0: 1.2, 120.0: 8.0}
    base = {0.0: (1.0, 30.0), 60.0: (1.0, 30.0), 120.0: (2.0, 40.0)}
    fast_alone = {0.0: (1.0, 45.0), 60.0: (1.0, 45.0), 120.0: (2.0, 30.0)}
    got = speedup_by_load(fast_alone, base, load)
    assert got["1"] == pytest.approx(1.5)
    assert got["5-16"] == pytest.approx(0.75)
    assert got["2-4"] is None and got[">16"] is None


def test_since_takes_durations_and_times():
    assert parse_since("30m", now=10_000) == 8_200
    assert parse_since("1700000000", now=0) == 1_700_000_000
    assert parse_since("2026-01-01T00:00:00+00:00", now=0) == 1_767_225_600
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday", now=0)
