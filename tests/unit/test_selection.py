import random
from collections import Counter

import pytest

from specserve.router.selection import UnknownArmError, choose_arm, random_arm, sticky_arm

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
    assert choose_arm(weights, override="b", sticky_key="k") == "b"
    with pytest.raises(UnknownArmError, match="unknown arm 'zz'"):
        choose_arm(weights, override="zz")


def test_random_split_without_key_follows_weights():
    weights = {"a": 3, "b": 1}
    rng = random.Random(7)
    n = 20_000
    counts = Counter(choose_arm(weights, rng=rng) for _ in range(n))
    assert_close_to_weights({a: counts[a] / n for a in weights}, weights, n)


def test_no_positive_weight_is_an_error():
    with pytest.raises(ValueError):
        sticky_arm("k", {"a": 0})
