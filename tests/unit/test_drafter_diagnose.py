"""The drift diagnostic on small random drafters: it observes the forward pass without changing
it, its attention shares add up the way the draft-step mask allows, and it tells EAGLE-3's
growing fed-forward state from EAGLE-3.1's normalized one."""

import torch

from specserve.drafter.diagnose import (
    SINK_TOKENS,
    Probe,
    copy_split,
    lookup_first_acceptance,
    lookup_next,
    markdown,
)
from tests.unit.test_drafter_model import make

STEPS = 4
T = 24


def record(answer_start: int = 12) -> dict:
    torch.manual_seed(2)
    aux = torch.randn(T, 3 * 64)
    aux[:, :64] *= 50
    return {
        "input_ids": torch.randint(0, 300, (T,)),
        "aux": aux,
        "answer_start": answer_start,
    }


def test_the_probe_changes_nothing_it_observes():
    from specserve.drafter.train import sequence_batch

    model = make(fc_norm=True, norm_output=True)
    aux, inputs, _, _, first = sequence_batch(record(), STEPS, max_len=1 << 30)
    with torch.no_grad():
        before = model.unrolled(aux, inputs, STEPS, logits_from=first)
        with Probe(model, STEPS) as probe:
            observed = model.unrolled(aux, inputs, STEPS, logits_from=first)
        recorded = probe.queries.clone()
        model.unrolled(aux, inputs, STEPS, logits_from=first)  # the probe is gone: not recorded
    for a, b in zip(before, observed, strict=True):
        torch.testing.assert_close(a, b)
    assert recorded[0] > 0 and torch.equal(probe.queries, recorded)


def test_attention_shares_follow_the_draft_mask():
    probe = Probe(make(), STEPS)
    probe.run(record())
    result = probe.result()
    context, own = result["attention_context"], result["attention_own_drafts"]
    # Step 1 sees only the context; every query's attention sums to 1 over context + drafts.
    assert own[0] == 0
    for c, o in zip(context, own, strict=True):
        assert abs(c + o - 1) < 1e-5
    assert all(o > 0 for o in own[1:])
    assert all(0 < s <= c for s, c in zip(result["attention_sink"], context, strict=True))
    assert len(result["hidden_rms"]) == STEPS + 1


def test_eagle31_feeds_a_normalized_state_forward():
    """EAGLE-3.1 feeds the post-norm state on, whose RMS is set by the norm's weights; EAGLE-3
    feeds the pre-norm residual stream, which carries the target states' scale."""
    plain, switched = Probe(make(), STEPS), Probe(make(fc_norm=True, norm_output=True), STEPS)
    for probe in (plain, switched):
        probe.run(record())
    fed_plain = plain.result()["hidden_rms"][1:]
    fed_norm = switched.result()["hidden_rms"][1:]
    assert max(fed_norm) < 2  # norm weights are in [0.5, 1.5]
    assert min(fed_plain) > 5 * max(fed_norm)


def test_the_table_has_a_row_per_figure():
    probe = Probe(make(), STEPS)
    probe.run(record())
    row = {"drafter": "d", "set": "chat", **probe.result()}
    row["acceptance_by_position"] = [0.5, 0.25, 0.1, 0.05]
    row["acceptance_given_previous"] = [0.5, 0.5, 0.4, 0.5]
    row |= {"copyable_share": 0.4, "first_step_right_copyable": 0.7, "first_step_right_other": 0.3}
    row |= {"acceptance_length": 1.9, "acceptance_length_lookup_first": 2.25}
    table = markdown({"steps": STEPS, "sink_tokens": SINK_TOKENS, "results": [row]})
    assert table.count("\n| d | chat |") == 7
    assert "| d | chat | 0.400 | 0.700 | 0.300 | 1.900 | 2.250 |" in table
    assert "| step 4 |" in table


def test_a_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    # "5 6" occurred twice (then 7, then 8): the latest occurrence wins.
    assert lookup_next([5, 6, 7, 1, 5, 6, 8, 2, 5, 6]) == 8
    # The 3-token suffix "9 5 6" occurred once, followed by 4: longer beats later.
    assert lookup_next([9, 5, 6, 4, 1, 5, 6, 8, 9, 5, 6]) == 4
    assert lookup_next([1, 2, 3, 4]) is None  # no suffix of 2+ tokens occurred before
    assert lookup_next([1, 2, 1, 3]) is None  # a 1-token match is below the shortest


def test_the_copy_split_divides_the_first_steps_top1_between_copyable_and_other_tokens():
    """A drafter that drafts what a prompt lookup proposes gets every copyable token and few of
    the others; the two figures, weighted by the share, make the first step's top-1."""
    from specserve.drafter.train import offline_acceptance

    model = make(fc_norm=True, norm_output=True).eval()
    rec = record(answer_start=8)
    torch.manual_seed(3)
    ids = model.draft_ids()[torch.randint(0, 100, (T,))]  # every token in the draft vocabulary
    ids[14:20] = ids[8:14]  # the answer repeats itself: some tokens are copyable
    rec["input_ids"] = ids

    def lookup_drafter(aux, inputs, steps, logits_from=0):
        tokens = ids.tolist()
        proposed = [lookup_next(tokens[: t + 2]) for t in range(logits_from, aux.shape[1])]
        logits = torch.zeros(1, len(proposed), model.config.draft_vocab_size)
        for i, token in enumerate(proposed):
            if token is not None:
                logits[0, i, model.to_draft(torch.tensor(token))] = 1.0
        return [logits]

    model.unrolled = lookup_drafter
    split = copy_split(model, [rec])
    assert 0 < split["copyable_share"] < 1
    assert split["first_step_right_copyable"] == 1.0
    assert split["first_step_right_other"] < 0.5
    share = split["copyable_share"]
    mixed = share + (1 - share) * split["first_step_right_other"]
    assert abs(mixed - offline_acceptance(model, [rec], 1).step_top1[0]) < 1e-6


def test_a_lookup_first_takes_every_draft_of_an_answer_that_repeats_its_prompt():
    """An answer that is its prompt again: from the first 3 repeated tokens on, the lookup
    drafts the next k exactly, whatever the drafter guesses; the drafter alone gets none (it
    guesses one token everywhere). Before the repeat is 3 tokens long the drafter's stand."""
    model = make(fc_norm=True, norm_output=True).eval()
    rec = record(answer_start=12)
    vocabulary = model.draft_ids()
    ids = vocabulary[torch.arange(12) + 10].repeat(2)  # 12 distinct tokens, then them again
    rec["input_ids"] = ids

    def one_guess(aux, inputs, steps, logits_from=0):
        logits = torch.zeros(1, aux.shape[1] - logits_from, model.config.draft_vocab_size)
        logits[..., 0] = 1.0  # draft id 0, never in the sequence
        return [logits] * steps

    model.unrolled = one_guess
    k = 3
    out = lookup_first_acceptance(model, [rec], k=k, shortest=3)
    assert out["acceptance_length"] == 1.0
    # Draft positions 12..23 (each answer token's index): from 15 on the last 3 tokens recur;
    # drafts at 15..21 are all right (k each), at 22 two tokens remain, at 23 one.
    positions = list(range(12, T))
    accepted = sum(min(k, T - p) for p in positions if p >= 15)
    assert abs(out["acceptance_length_lookup_first"] - (1 + accepted / len(positions))) < 1e-9
