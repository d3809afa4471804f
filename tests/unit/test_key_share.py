"""routing.max_key_share (router/key_share.py): among any `window` consecutive requests counted
for an arm, no key holds more than its share, whatever the order keys arrive in."""

import math

from hypothesis import given
from hypothesis import strategies as st

from specserve.router.key_share import KeyShare


@given(
    keys=st.lists(st.sampled_from("abcde"), max_size=400),
    share=st.sampled_from([0.05, 0.2, 0.25, 0.5, 1.0]),
    window=st.integers(10, 60),
)
def test_no_key_holds_more_than_its_share_of_any_window_of_counted_requests(keys, share, window):
    bound = KeyShare()
    most = max(1, math.floor(share * window))
    counted: list[str] = []
    for key in keys:
        if bound.count("arm", key, share, window):
            counted.append(key)
        else:  # refused only when the key holds its share of the last window counted
            assert counted[-window:].count(key) >= most
    for start in range(max(1, len(counted) - window + 1)):
        held = counted[start : start + window]
        assert all(held.count(key) <= most for key in set(held))


def test_unset_counts_everything_and_arms_are_held_apart():
    bound = KeyShare()
    assert all(bound.count("arm", "a", None, 10) for _ in range(100))
    assert [bound.count("x", "a", 0.2, 10) for _ in range(3)] == [True, True, False]
    assert bound.count("y", "a", 0.2, 10)  # another arm, its own window
    for key in "bcdefghijk":  # others fill the window and push key a's requests out
        bound.count("x", key, 0.2, 10)
    assert bound.count("x", "a", 0.2, 10)
