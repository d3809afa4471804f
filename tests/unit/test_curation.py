"""What adapt learns from (drafter/curation.py): near-duplicates found and dropped, whatever
part of a sequence varies, distinct sequences kept; no key over its share of the rows kept,
whatever the mix of keys."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from specserve.drafter.curation import (
    cap_key_share,
    drop_near_duplicates,
    jaccard,
    key_cap,
    shingles,
)


def row(prompt, output, key=None) -> dict:
    return {"prompt_token_ids": list(prompt), "output_token_ids": list(output), "key": key}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def test_a_template_with_one_slot_changed_is_a_near_duplicate_and_new_text_is_not():
    rng = random.Random(7)
    template, answer = tokens(rng, 300), tokens(rng, 120)
    rows = [row(template, answer)]
    for slot in range(5):  # the same request with one slot value changed
        varied = list(template)
        varied[40:42] = [slot, slot + 1]
        rows.append(row(varied, answer))
    distinct = [row(tokens(rng, 300), tokens(rng, 120)) for _ in range(50)]
    kept, dropped = drop_near_duplicates(rows + distinct)
    assert dropped == 5 and kept == [rows[0], *distinct]  # the oldest of each is kept


def test_the_same_prompt_with_another_answer_is_kept():
    rng = random.Random(8)
    prompt = tokens(rng, 50)
    rows = [row(prompt, tokens(rng, 200)), row(prompt, tokens(rng, 200))]
    assert drop_near_duplicates(rows) == (rows, 0)


@given(st.integers(0, 2**32 - 1))
def test_minhash_misses_no_near_duplicate_it_is_shown(seed):
    rng = random.Random(seed)
    base = tokens(rng, 400)
    edited = list(base)
    for i in rng.sample(range(400), 4):  # 4 tokens changed: Jaccard of 4-grams ~0.92
        edited[i] = rng.randrange(49_152)
    assert jaccard(shingles(base), shingles(edited)) >= 0.8
    assert drop_near_duplicates([row(base, []), row(edited, [])])[1] == 1


@given(
    counts=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 60), min_size=2),
    unkeyed=st.integers(0, 30),
    share=st.sampled_from([0.1, 0.25, 0.5, 0.9]),
)
def test_no_key_keeps_more_than_its_share_and_the_cap_is_the_largest_that_holds(
    counts, unkeyed, share
):
    rows = [row([i], [i], key) for key, n in counts.items() for i in range(n)]
    rows += [row([i], [i]) for i in range(unkeyed)]
    random.Random(0).shuffle(rows)
    kept, dropped = cap_key_share(rows, share)
    cap = key_cap(counts, unkeyed, share)
    per_key = {key: sum(r["key"] == key for r in kept) for key in counts}
    assert all(n <= max(cap, 0) and n <= share * len(kept) for n in per_key.values())
    assert all(per_key[key] == min(n, cap) for key, n in counts.items())  # no more dropped
    assert sum(dropped.values()) == len(rows) - len(kept)
    # One more row for the capped keys would break the share.
    if dropped:
        assert cap + 1 > share * (unkeyed + sum(min(n, cap + 1) for n in counts.values()))


def test_a_key_over_its_share_keeps_its_newest_rows_and_one_key_alone_is_not_capped():
    rows = [row([i], [i], "big") for i in range(10)] + [row([99], [99], "small")]
    kept, dropped = cap_key_share(rows, 0.5)
    assert dropped == {"big": 9} and kept == [rows[9], rows[10]]
    alone = [row([i], [i], "gateway") for i in range(10)]
    assert cap_key_share(alone, 0.5) == (alone, {})
    assert cap_key_share(rows, 1.0) == (rows, {})
