"""The drift diagnostic on small random drafters: it observes the forward pass without changing
it, its attention shares add up the way the draft-step mask allows, and it tells EAGLE-3's
growing fed-forward state from EAGLE-3.1's normalized one."""

import torch

from specserve.drafter.diagnose import SINK_TOKENS, Probe, markdown
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
    table = markdown({"steps": STEPS, "sink_tokens": SINK_TOKENS, "results": [row]})
    assert table.count("\n| d | chat |") == 6
    assert "| step 4 |" in table
