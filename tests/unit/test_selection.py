import random
from collections import Counter

import pytest

from specserve.metrics import (
    SELECTED_BY_CAPABILITY,
    SELECTED_BY_OVERRIDE,
    SELECTED_BY_STICKY,
    SELECTED_BY_WEIGHT,
    UNIT_BUCKETS,
)
from specserve.router.selection import (
    ArmNotRunningError,
    NoAbleArmError,
    Selection,
    UnknownArmError,
    choose_arm,
    load_salt,
    random_arm,
    sticky_arm,
    unit_bucket,
)

KEYS = [f"user-{i}" for i in range(20_000)]


def shares(weights, keys=KEYS):
    counts = Counter(sticky_arm(k, weights) for k in keys)
    return {arm: counts[arm] / len(keys) for arm in weights}


def assert_close_to_weights(observed: dict, weights: dict, n: int) -> None:
    total = sum(weights.values())
    for arm, w in weights.items():
        p = w / total
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(observed[arm] - p) <= 5 * sigma + 1e-12, (arm, observed[arm], p)


@pytest.mark.parametrize(
    "weights",
    [{"a": 50, "b": 50}, {"a": 90, "b": 10}, {"a": 1, "b": 2, "c": 7}, {"a": 0.2, "b": 0.8}],
)
def test_sticky_split_follows_weights(weights):
    assert_close_to_weights(shares(weights), weights, len(KEYS))


def test_zero_weight_arm_never_chosen_without_override():
    weights = {"a": 1, "b": 0}
    assert set(shares(weights).values()) == {1.0, 0.0}
    assert shares(weights)["a"] == 1.0
    rng = random.Random(0)
    assert {random_arm(weights, rng) for _ in range(500)} == {"a"}


def test_same_key_same_arm_while_weights_unchanged():
    weights = {"a": 1, "b": 1, "c": 1}
    first = {k: sticky_arm(k, weights) for k in KEYS[:2000]}
    # A reordered mapping with the same weights is the same configuration.
    reordered = {"c": 1, "a": 1, "b": 1}
    assert first == {k: sticky_arm(k, reordered) for k in KEYS[:2000]}


def test_growing_one_weight_moves_keys_only_to_that_arm():
    before = {"a": 50, "b": 50}
    after = {"a": 50, "b": 100}  # b: 1/2 -> 2/3 of traffic
    moved = [(sticky_arm(k, before), sticky_arm(k, after)) for k in KEYS]
    changes = [(x, y) for x, y in moved if x != y]
    assert all(y == "b" for _, y in changes)
    # The minimum share that must move is 2/3 - 1/2 = 1/6 of the keys.
    assert abs(len(changes) / len(KEYS) - 1 / 6) < 0.02


def test_adding_an_arm_moves_only_its_share():
    before = {"a": 1, "b": 1}
    after = {"a": 1, "b": 1, "c": 1}
    changes = [k for k in KEYS if sticky_arm(k, before) != sticky_arm(k, after)]
    assert all(sticky_arm(k, after) == "c" for k in changes)
    assert abs(len(changes) / len(KEYS) - 1 / 3) < 0.02


def test_override_wins_even_for_zero_weight_and_unknown_is_an_error():
    weights = {"a": 1, "b": 0}
    assert choose_arm(weights, override="b", sticky_key="k") == Selection("b", SELECTED_BY_OVERRIDE)
    with pytest.raises(UnknownArmError, match="unknown arm 'zz'"):
        choose_arm(weights, override="zz")


def test_random_split_without_key_follows_weights():
    weights = {"a": 3, "b": 1}
    rng = random.Random(7)
    n = 20_000
    selections = [choose_arm(weights, rng=rng) for _ in range(n)]
    assert {s.selected_by for s in selections} == {SELECTED_BY_WEIGHT}
    counts = Counter(s.arm for s in selections)
    assert_close_to_weights({a: counts[a] / n for a in weights}, weights, n)


def test_no_positive_weight_is_an_error():
    with pytest.raises(ValueError):
        sticky_arm("k", {"a": 0})


def test_arms_that_are_not_running_get_no_weighted_or_sticky_traffic():
    weights = {"a": 1, "b": 1, "c": 2}
    running = {"a", "b"}
    rng = random.Random(3)
    n = 20_000
    picks = [choose_arm(weights, routable=running, rng=rng) for _ in range(n)]
    assert {p.arm for p in picks} == {"a", "b"}
    # c's half of the draws fell back and was counted; the rest splits by the running weights.
    fell_back = [p for p in picks if p.fallback_from is not None]
    assert {p.fallback_from for p in fell_back} == {"c"}
    assert abs(len(fell_back) / n - 0.5) < 0.02
    counts = Counter(p.arm for p in picks)
    assert_close_to_weights({a: counts[a] / n for a in "ab"}, {"a": 1, "b": 1}, n)


def test_sticky_keys_of_a_stopped_arm_fall_back_and_the_others_stay():
    weights = {"a": 1, "b": 1, "c": 1}
    for key in KEYS[:3000]:
        usual = sticky_arm(key, weights)
        got = choose_arm(weights, routable={"a", "b"}, sticky_key=key)
        assert got.selected_by == SELECTED_BY_STICKY
        if usual == "c":
            assert got.fallback_from == "c" and got.arm == sticky_arm(key, {"a": 1, "b": 1})
        else:
            assert got == Selection(usual, SELECTED_BY_STICKY)


def test_override_to_an_arm_that_is_not_running_and_nothing_running_are_errors():
    weights = {"a": 1, "b": 0}
    with pytest.raises(ArmNotRunningError, match="arm 'a' is not running"):
        choose_arm(weights, routable={"b"}, override="a")
    assert choose_arm(weights, routable={"b"}, override="b").arm == "b"
    # Only a weight-0 arm runs: nothing may take weighted traffic.
    with pytest.raises(ArmNotRunningError, match=r"no arm with weight > 0 is running"):
        choose_arm(weights, routable={"b"}, sticky_key="k")


def test_a_salt_reassigns_keys_as_a_fresh_draw_keeping_the_split_and_stickiness(tmp_path):
    """Without the deployment's salt, which key lands on which arm cannot be worked out: a
    salted assignment agrees with the unsalted one only as two independent draws would."""
    weights = {"a": 1, "b": 1}
    (tmp_path / "salt").write_text("deployment secret")
    salt = load_salt(str(tmp_path / "salt"))
    assert len(salt) == 32 and load_salt(None) == b""
    plain = [sticky_arm(k, weights) for k in KEYS]
    salted = [sticky_arm(k, weights, salt) for k in KEYS]
    agree = sum(p == q for p, q in zip(plain, salted, strict=True)) / len(KEYS)
    assert abs(agree - 0.5) < 5 * (0.25 / len(KEYS)) ** 0.5  # chance agreement, no more
    counts = Counter(salted)
    assert_close_to_weights({a: counts[a] / len(KEYS) for a in weights}, weights, len(KEYS))
    assert salted == [sticky_arm(k, weights, salt) for k in KEYS]  # still sticky
    assert salted != [sticky_arm(k, weights, b"another deployment") for k in KEYS]
    selection = choose_arm(weights, sticky_key=KEYS[0], salt=salt)
    assert selection.arm == salted[0]


def test_a_salt_file_that_cannot_be_read_leaves_the_hash_unsalted_and_says_so(tmp_path, caplog):
    assert load_salt(str(tmp_path / "missing")) == b""
    assert "unsalted" in caplog.text


def test_a_keys_unit_bucket_is_fixed_and_independent_of_its_arm():
    """All of a key's requests share one bucket (the report's cluster-robust groups need it), the
    keys of each arm spread evenly over the buckets (a bucket does not tell the arm), and a
    request without a key is its own unit in a random bucket."""
    assert {unit_bucket("user-7", b"s") for _ in range(5)} == {unit_bucket("user-7", b"s")}
    weights = {"a": 1, "b": 1}
    by_arm: dict[str, Counter] = {"a": Counter(), "b": Counter()}
    for key in KEYS:
        by_arm[sticky_arm(key, weights)][unit_bucket(key)] += 1
    for counts in by_arm.values():
        n = sum(counts.values())
        assert set(counts) == {str(b) for b in range(UNIT_BUCKETS)}
        expected = n / UNIT_BUCKETS
        assert max(abs(c - expected) for c in counts.values()) < 5 * expected**0.5
    rng = random.Random(3)
    keyless = Counter(unit_bucket(None, rng=rng) for _ in range(3200))
    assert len(keyless) == UNIT_BUCKETS and min(keyless.values()) > 50


def test_a_request_only_some_arms_can_serve_goes_to_them_by_their_weights_not_randomized():
    weights = {"spec": 2, "plain": 1, "plain2": 3}
    rng = random.Random(3)
    picks = [choose_arm(weights, able={"plain", "plain2"}, rng=rng) for _ in range(4_000)]
    assert {p.selected_by for p in picks} == {SELECTED_BY_CAPABILITY}
    counts = Counter(p.arm for p in picks)
    assert set(counts) == {"plain", "plain2"}
    assert abs(counts["plain"] / len(picks) - 0.25) < 0.03
    # A sticky key keeps its arm among them; an override is still the header's to decide.
    keyed = {choose_arm(weights, able={"plain", "plain2"}, sticky_key="u1").arm for _ in range(5)}
    assert len(keyed) == 1
    forced = choose_arm(weights, able={"plain"}, override="spec")
    assert forced == Selection("spec", SELECTED_BY_OVERRIDE)


def test_able_arms_of_weight_0_or_drained_still_serve_and_none_running_is_an_error():
    weights = {"spec": 1, "plain": 0, "plain2": 0}
    rng = random.Random(5)
    arms = {choose_arm(weights, able={"plain", "plain2"}, rng=rng).arm for _ in range(200)}
    assert arms == {"plain", "plain2"}  # evenly where every able arm has weight 0
    drained = choose_arm(weights, able={"plain", "plain2"}, drained={"plain"})
    assert drained.arm == "plain2"
    only_drained = choose_arm(weights, able={"plain"}, drained={"plain"})
    assert only_drained.arm == "plain"  # a drain never leaves the request without an arm
    with pytest.raises(NoAbleArmError):
        choose_arm(weights, able={"plain"}, routable={"spec", "plain2"})
    with pytest.raises(NoAbleArmError):
        choose_arm(weights, able=set())
