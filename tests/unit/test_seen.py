"""How much of a loop's A/B traffic its candidate was trained on (drafter/seen.py), from prompts
and from a real capture store."""

from __future__ import annotations

import math
import random

import pytest

from specserve.capture.store import Bounds, CaptureWriter, Record
from specserve.drafter.adapt import split_by_prompt
from specserve.drafter.seen import ab_traffic_seen, seen_in_training

BIG = Bounds(max_records=100_000, max_age_s=86_400)


def prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


def test_exact_and_near_repeats_of_training_prompts_are_told_from_new_ones():
    training = [prompt(i) for i in range(50)]
    one_slot_changed = [*training[3][:30], 7, *training[3][31:]]
    served = [training[0], training[1], one_slot_changed, prompt(1000), prompt(1001)]
    found = seen_in_training(training, served)
    assert found == {"sampled": 5, "exact": 2 / 5, "near": 3 / 5}
    nothing = seen_in_training(training, [])
    assert nothing["sampled"] == 0 and math.isnan(nothing["exact"])


def test_the_ab_share_counts_the_incumbents_prompts_after_its_start_against_the_training_split(
    tmp_path,
):
    """Captured before the A/B: 300 prompts, of which adapt's split trains on some; during it the
    incumbent serves 40 of the training ones, 40 of the held-out ones and 40 new ones (a
    challenger without capture records nothing)."""
    before = [prompt(i) for i in range(300)]
    training, validation, held_out = split_by_prompt(
        [{"prompt_token_ids": p} for p in before], 0.2, 0.1
    )
    assert len(training) >= 40 and len(held_out) >= 40
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    for p in before:
        assert writer.put(Record("eagle3", "chat", p, [1, 2], "stop", at=100.0), BIG)
    during = [row["prompt_token_ids"] for row in training[:40] + held_out[:40]]
    during += [prompt(5000 + i) for i in range(40)]
    for p in during:
        assert writer.put(Record("eagle3", "chat", p, [1, 2], "stop", at=200.0), BIG)
    writer.close()
    found = ab_traffic_seen(tmp_path, "eagle3", "eagle3", 150.0, 0.2, 0.1)
    assert found["sampled"] == 120
    assert found["exact"] == pytest.approx(1 / 3) and found["near"] == pytest.approx(1 / 3)
    assert "eagle3's capture sample" in found["estimated_from"]
    # An incumbent that captured nothing since the start: the share is not known.
    assert (
        "captured no request"
        in ab_traffic_seen(tmp_path, None, "eagle3", 300.0, 0.2, 0.1)["unknown"]
    )
