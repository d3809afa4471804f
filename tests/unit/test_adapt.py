"""The parts of `specserve drafter adapt` (drafter/adapt.py) that decide what it trains on, what
it is scored on, what the candidate is called and whether it is accepted."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.capture.store import Bounds, CaptureWriter, Record
from specserve.drafter.adapt import (
    CAPTURED_SET,
    AdaptConfig,
    captured_sequences,
    content_addressed,
    judge,
    replay_pick,
    sampling_summary,
    scored_prompt,
    split_by_prompt,
)

BOUNDS = Bounds(max_records=10_000, max_age_s=86_400)


def capture(directory, arm: str, records: list[tuple[list[int], list[int]]]) -> None:
    writer = CaptureWriter(directory, arm, "r1")
    for prompt, output in records:
        assert writer.put(Record(arm, "chat", prompt, output, "stop"), BOUNDS)
    writer.close()


def test_captured_answers_come_back_unique_long_enough_and_per_arm(tmp_path):
    capture(tmp_path, "eagle3", [([1, 2], [5, 6, 7, 8]), ([1, 2], [5, 6, 7, 8]), ([3], [9, 9])])
    capture(tmp_path, "no-spec", [([4], [1, 2, 3, 4, 5])])
    rows = captured_sequences(tmp_path)
    # The duplicate is kept once, the 2-token answer not at all.
    assert sorted(r["prompt_token_ids"] for r in rows) == [[1, 2], [4]]
    assert {r["kind"] for r in rows} == {"captured:eagle3", "captured:no-spec"}
    only = captured_sequences(tmp_path, "no-spec")
    assert [r["output_token_ids"] for r in only] == [[1, 2, 3, 4, 5]]


def test_the_gate_scores_each_held_out_prompt_under_the_sampling_it_was_served_with(tmp_path):
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    older = Record("eagle3", "chat", [1, 2], [5, 6, 7, 8], "stop")  # before sampling was kept
    sampled = Record("eagle3", "chat", [3], [5, 6, 7, 9], "stop", sampling={"temperature": 0.7})
    defaults = Record("eagle3", "chat", [4], [5, 6, 7, 7], "stop", sampling={})
    for record in (older, sampled, defaults):
        assert writer.put(record, BOUNDS)
    writer.close()
    rows = {tuple(r["prompt_token_ids"]): r for r in captured_sequences(tmp_path)}
    assert scored_prompt(rows[(1, 2)]) == {"prompt_token_ids": [1, 2]}  # greedy
    assert scored_prompt(rows[(3,)]) == {"prompt_token_ids": [3], "sampling": {"temperature": 0.7}}
    assert scored_prompt(rows[(4,)]) == {"prompt_token_ids": [4], "sampling": {}}
    assert sampling_summary(list(rows.values())) == {
        "as_captured": 2,
        "greedy_not_captured": 1,
        "engine_default_temperature": 1,
        "temperatures": [0.7],
    }


def test_relative_paths_are_made_absolute_for_the_train_workers_directories(tmp_path, monkeypatch):
    """Ray Train's workers run elsewhere: `--work-dir out/` must name the same files there."""
    monkeypatch.chdir(tmp_path)
    config = AdaptConfig("package://eagle3.1", "captured", "out/work", "out/adapted", "target",
                         replay_from="build")  # fmt: skip
    assert config.work_dir == tmp_path / "out/work" and config.out_dir == tmp_path / "out/adapted"
    assert config.captured == tmp_path / "captured" and config.replay_from == tmp_path / "build"


def test_every_answer_to_one_prompt_falls_in_one_part_in_the_asked_shares():
    rows = [
        {"prompt_token_ids": [p, p + 1], "output_token_ids": [a] * 4}
        for p in range(2000)
        for a in range(3)
    ]
    training, validation, held_out = split_by_prompt(rows, 0.2, 0.1)
    assert len(training) + len(validation) + len(held_out) == len(rows)
    prompts = [{tuple(r["prompt_token_ids"]) for r in part} for part in (training, validation)]
    held = {tuple(r["prompt_token_ids"]) for r in held_out}
    assert not (prompts[0] & held) and not (prompts[1] & held) and not (prompts[0] & prompts[1])
    assert len(held) / 2000 == pytest.approx(0.2, abs=0.03)
    assert len(prompts[1]) / 2000 == pytest.approx(0.8 * 0.1, abs=0.02)
    # Stable: the same rows split the same way, and adding rows does not move old ones.
    more = rows + [{"prompt_token_ids": [9999, 1], "output_token_ids": [1] * 4}]
    assert split_by_prompt(more, 0.2, 0.1)[2][: len(held_out)] == held_out


def test_replay_picks_the_same_records_whatever_the_shards_order():
    records = [{"input_ids": torch.tensor([i, i + 1, i + 2])} for i in range(100)]
    shards = [records[i : i + 10] for i in range(0, 100, 10)]
    picked = replay_pick(iter(shards), 7)
    assert len(picked) == 7
    again = replay_pick(iter(reversed(shards)), 7)
    assert [r["input_ids"].tolist() for r in again] == [r["input_ids"].tolist() for r in picked]
    other_seed = replay_pick(iter(shards), 7, seed=1)
    assert [r["input_ids"].tolist() for r in other_seed] != [
        r["input_ids"].tolist() for r in picked
    ]
    assert replay_pick(iter(shards), 0) == []
    assert len(replay_pick(iter(shards), 500)) == 100


def export(directory, weights: bytes, fc_norm: bool):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"fc_norm": True} if fc_norm else {}))
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_a_candidate_is_named_by_its_variant_and_the_digest_of_its_files(tmp_path):
    a = content_addressed(export(tmp_path / "a", b"weights", True), tmp_path / "out")
    assert a.name.startswith("eagle3.1-") and len(a.name) == len("eagle3.1-") + 12
    assert (a / "model.safetensors").read_bytes() == b"weights"
    same = content_addressed(export(tmp_path / "b", b"weights", True), tmp_path / "out")
    assert same == a  # the same files: the same name, copied once
    other = content_addressed(export(tmp_path / "c", b"other", False), tmp_path / "out")
    assert other.name.startswith("eagle3-") and other != a
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([a.name, other.name])


def row(drafter: str, prompt_set: str, per_prompt: list[list[int]], k: int = 3) -> dict:
    drafts = sum(d for d, _ in per_prompt)
    accepted = sum(a for _, a in per_prompt)
    return {
        "drafter": drafter,
        "prompt_set": prompt_set,
        "k": k,
        "mean_acceptance_length": 1 + accepted / drafts,
        "per_prompt": per_prompt,
    }


def scores(captured_base, captured_candidate, chat_base=None, chat_candidate=None) -> list[dict]:
    rows = [
        row("base", CAPTURED_SET, captured_base),
        row("candidate", CAPTURED_SET, captured_candidate),
    ]
    if chat_base:
        rows += [row("base", "chat", chat_base), row("candidate", "chat", chat_candidate)]
    return rows


def test_a_candidate_is_accepted_only_when_better_on_captured_traffic_beyond_noise():
    base = [[40, 40 + i % 5] for i in range(30)]  # length ~2.05
    better = [[30, 50 + i % 5] for i in range(30)]  # length ~2.73
    verdict = judge(scores(base, better), k=3)
    assert verdict.accepted, verdict.reason
    assert verdict.captured_ratio[1] > 1 and verdict.reason.startswith("better")
    # Better on average, but on 3 prompts: the interval reaches below 1x.
    noisy_base = [[40, 10], [40, 60], [40, 30]]
    noisy_candidate = [[40, 60], [40, 10], [40, 45]]
    verdict = judge(scores(noisy_base, noisy_candidate), k=3)
    assert not verdict.accepted and verdict.reason.startswith("not better")
    assert verdict.captured_ratio[0] > 1 > verdict.captured_ratio[1]
    # The same: no better.
    assert not judge(scores(base, base), k=3).accepted


def test_a_candidate_that_forgets_the_original_sets_is_rejected():
    base = [[40, 40 + i % 5] for i in range(30)]
    better = [[30, 50 + i % 5] for i in range(30)]
    chat = [[40, 60] for _ in range(10)]
    kept = [[40, 58] for _ in range(10)]  # 2.45 / 2.5 = 0.98x: within 5 %
    forgot = [[40, 50] for _ in range(10)]  # 2.25 / 2.5 = 0.90x
    assert judge(scores(base, better, chat, kept), k=3).accepted
    verdict = judge(scores(base, better, chat, forgot), k=3)
    assert not verdict.accepted
    assert verdict.reason == "forgets the original sets: chat 0.900x"
    assert verdict.original_ratios["chat"] == pytest.approx(0.9)


def test_a_base_that_is_no_checkpoint_directory_is_refused_before_any_work(tmp_path, capsys):
    from specserve.cli import main

    captured = tmp_path / "captured"
    capture(captured, "eagle3.1", [([1, 2, 3, i], [4, 5, 6, 7, 8]) for i in range(40)])
    work = tmp_path / "work"
    argv = ["drafter", "adapt", "--captured", str(captured), "--work-dir", str(work)]
    assert main([*argv, "--base", "eagle3.1"]) == 2
    error = capsys.readouterr().err
    assert "drafter 'eagle3.1' is no checkpoint directory" in error
    assert "did you mean package://eagle3.1?" in error
    assert not work.exists()  # refused before the work directory was made
    assert main([*argv, "--base", "org/hub-drafter"]) == 2
    assert "did you mean" not in capsys.readouterr().err
