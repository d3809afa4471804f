"""How much of a loop's A/B traffic its candidate was trained on (drafter/seen.py), from prompts
and from a real capture store."""

from __future__ import annotations

import math
import random

import pytest

from specserve.capture.store import Bounds, CaptureWriter, Record
from specserve.config.schema import MAX_LEFT_OUT_PROMPTS, ConfigError, parse_config
from specserve.drafter.adapt import split_by_prompt
from specserve.drafter.seen import ab_traffic_seen, seen_in_training, training_digests
from specserve.wire.requests import prompt_digest

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


def test_a_prompts_digest_ignores_case_spacing_and_numbers_and_nothing_else():
    def chat(*texts: str, role: str = "user") -> dict:
        return {"messages": [{"role": role, "content": t} for t in texts]}

    first = prompt_digest(chat("Ship order 42 to Bob"), "chat")
    assert len(first) == 16 and int(first, 16) >= 0
    assert prompt_digest(chat("ship  order 7 to BOB"), "chat") == first
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Ship order 1 to Bob"}]}]
    }
    assert prompt_digest(parts, "chat") == first
    for other in (chat("Ship order 42 to Alice"), chat("Ship order 42 to Bob", role="system")):
        assert prompt_digest(other, "chat") != first
    assert prompt_digest(chat("a", "b"), "chat") != prompt_digest(chat("a b"), "chat")
    assert prompt_digest({"prompt": "Ship order 42 to Bob"}, "completions") != first
    token_ids = prompt_digest({"prompt": [1, 2, 3]}, "completions")
    assert token_ids != prompt_digest({"prompt": [1, 2, 4]}, "completions")  # ids are not text


def test_the_config_takes_digests_only_and_a_bounded_number_of_them():
    base = "model: {name: m, source: /m, accelerator: cpu}\narms: [{name: a, weight: 1}]\n"
    config = parse_config(base + "routing: {ab_left_out_prompts: ['0123456789abcdef']}\n")
    assert config.routing.ab_left_out_prompts == frozenset({"0123456789abcdef"})
    for bad in ("['0123']", "['0123456789ABCDEF']", "['not a digest at all']"):
        with pytest.raises(ConfigError, match="ab_left_out_prompts"):
            parse_config(base + f"routing: {{ab_left_out_prompts: {bad}}}\n")
    many = [f"{i:016x}" for i in range(MAX_LEFT_OUT_PROMPTS + 1)]
    with pytest.raises(ConfigError, match="ab_left_out_prompts"):
        parse_config(base + f"routing: {{ab_left_out_prompts: {many}}}\n")


def test_the_digests_left_out_are_those_of_the_training_split_before_the_start(tmp_path):
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    prompts = [prompt(i) for i in range(300)]
    for i, p in enumerate(prompts):
        record = Record("eagle3", "chat", p, [1, 2], "stop", at=100.0, prompt_digest=f"{i:016x}")
        assert writer.put(record, BIG)
    assert writer.put(Record("eagle3", "chat", prompt(999), [1], "stop", at=100.0), BIG)
    after = Record("eagle3", "chat", prompt(7), [1, 2], "stop", at=500.0, prompt_digest="f" * 16)
    assert writer.put(after, BIG)
    writer.close()
    training, _, _ = split_by_prompt([{"prompt_token_ids": p} for p in prompts], 0.2, 0.1)
    expected = {f"{prompts.index(row['prompt_token_ids']):016x}" for row in training}
    assert training_digests(tmp_path, "eagle3", 200.0, 0.2, 0.1) == expected
    assert training_digests(tmp_path, "ngram", 200.0, 0.2, 0.1) == frozenset()
