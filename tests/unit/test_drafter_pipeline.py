"""Drafter pipeline pieces: self-instruct questions, the training mix, the held-out split and
the report table."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from specserve.drafter.pipeline import TRAIN_MIX, training_mix
from specserve.drafter.prompts import (
    Prompt,
    clean_question,
    is_held_out,
    self_instruct_prompts,
    shuffled,
)


def test_clean_question_keeps_one_question_and_drops_the_rest():
    assert clean_question('Question: "How do I keep basil alive indoors?"\nIt is hard.') == (
        "How do I keep basil alive indoors?"
    )
    assert clean_question("Here are some tips for growing basil.") is None  # not a question
    assert clean_question("Why?") is None  # too short to be a useful prompt
    assert clean_question("") is None


def test_self_instruct_prompts_are_chat_with_the_question_last_user_turn():
    questions = [f"What is the best way to learn topic number {i}?" for i in range(200)]
    prompts = self_instruct_prompts(questions)
    assert [p.kind for p in prompts] == ["chat"] * 200
    first_users = [next(m["content"] for m in p.messages if m["role"] == "user") for p in prompts]
    assert first_users == questions
    two_turn = [p for p in prompts if any(m["role"] == "assistant" for m in p.messages)]
    assert 0 < len(two_turn) < 100  # some, not most, become two-turn conversations
    for p in two_turn:  # the assistant turn is left for the target to write
        assert p.messages[-2] == {"role": "assistant", "content": ""}


def test_training_mix_takes_each_kinds_share_and_is_reproducible():
    prompts = [
        Prompt(kind, [{"role": "user", "content": f"{kind} {i}"}])
        for kind in TRAIN_MIX
        for i in range(1000)
    ]
    chosen = training_mix(prompts, 400)
    counts = {kind: sum(p.kind == kind for p in chosen) for kind in TRAIN_MIX}
    assert counts == {kind: round(share * 400) for kind, share in TRAIN_MIX.items()}
    assert training_mix(prompts, 400) == chosen
    assert training_mix(prompts, 400, seed=1) != chosen
    # Stable under growth: more prompts keep the ones chosen before (their answers are reused),
    # and one candidate more or less changes nothing else about the choice.
    keys = {p.messages[0]["content"] for p in chosen}
    assert keys <= {p.messages[0]["content"] for p in training_mix(prompts, 800)}
    fewer = {p.messages[0]["content"] for p in training_mix(prompts[1:], 400)}
    assert len(keys - fewer) <= 1


def test_shuffled_order_is_random_but_stable_under_insertion():
    prompts = [Prompt("chat", [{"role": "user", "content": f"q{i}"}]) for i in range(100)]
    order = [p.messages[0]["content"] for p in shuffled(prompts, "s")]
    assert order != [f"q{i}" for i in range(100)]
    extra = Prompt("chat", [{"role": "user", "content": "new"}])
    grown = [p.messages[0]["content"] for p in shuffled([*prompts, extra], "s")]
    assert [k for k in grown if k != "new"] == order


def test_prompts_of_some_kinds_are_all_kinds_filtered_and_unasked_sources_stay_unread(
    monkeypatch,
):
    from specserve.drafter import prompts

    pages = [(f"page{i}", f"A long page number {i}. " * 500) for i in range(40)]
    monkeypatch.setattr(prompts, "man_pages", lambda: pages)
    monkeypatch.setattr(prompts, "package_docs", lambda: [("pkg", "A package. " * 50)])
    everything = {side: prompts.build_prompts(held_out=side) for side in (True, False)}
    assert {p.kind for p in everything[True]} == set(prompts.KINDS)

    def unread():
        raise AssertionError("a source no asked kind needs was read")

    monkeypatch.setattr(prompts, "man_pages", unread)
    monkeypatch.setattr(prompts, "package_docs", unread)
    for kinds in ({"chat"}, {"chat", "code"}, {"perturbed"}, {"code", "template"}):
        for side, whole in everything.items():
            some = prompts.build_prompts(held_out=side, kinds=kinds)
            assert some == [p for p in whole if p.kind in kinds], (kinds, side)
            assert some or not side  # perturbed and template prompts are held out only
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        prompts.build_prompts(held_out=True, kinds={"poetry"})


def test_eval_sets_hold_the_sets_asked_for_each_of_its_own_kind(monkeypatch):
    from specserve.drafter import prompts
    from specserve.drafter.pipeline import EVAL_SETS, eval_sets

    def unread():
        raise AssertionError("man pages read for sets without long prompts")

    monkeypatch.setattr(prompts, "man_pages", unread)
    sets = eval_sets(3, ("chat", "coding", "template"))
    assert list(sets) == ["chat", "coding", "template"]
    assert all(len(prompts_) == 3 for prompts_ in sets.values())
    assert all(isinstance(m, list) and m[-1]["role"] == "user" for m in sets["chat"])
    assert all(isinstance(t, str) for t in sets["template"])  # rendered in a foreign template
    assert set(EVAL_SETS) >= {"chat", "coding", "long", "perturbed", "template"}
    with pytest.raises(ValueError, match="unknown prompt sets"):
        eval_sets(3, ("poetry",))


def test_held_out_split_is_about_a_fifth_and_stable():
    keys = [f"item {i}" for i in range(5000)]
    held = [k for k in keys if is_held_out(k)]
    assert 800 < len(held) < 1200
    assert held == [k for k in keys if is_held_out(k)]


def test_markdown_table_compares_the_last_drafter_with_the_first():
    from specserve.drafter.evaluate import Acceptance, markdown_table

    report = [
        Acceptance(name, k, "chat", 2, 100, 100 * k, accepted, [accepted] + [0] * (k - 1)).to_dict()
        for k in (5, 3)
        for name, accepted in (("eagle3", 50), ("eagle3.1", 75))
    ]
    lines = markdown_table(report).splitlines()
    assert lines[0].startswith("| prompt set | n | k | eagle3 | eagle3.1 | eagle3.1 / eagle3 |")
    assert lines[2] == "| chat | 2 | 3 | 1.50 | 1.75 | 1.17x | 0.75, 0.00, 0.00 |"  # k = 3 first
    assert lines[3].startswith("| chat | 2 | 5 | 1.50 | 1.75 | 1.17x |")


def test_markdown_table_compares_continued_drafters_with_where_they_started():
    from specserve.drafter.evaluate import Acceptance, markdown_table

    accepted = {"eagle3 (start)": 40, "eagle3.1 (start)": 50, "eagle3": 60, "eagle3.1": 80}
    report = [
        Acceptance(name, 3, "chat", 2, 100, 300, n, [n, 0, 0]).to_dict()
        for name, n in accepted.items()
    ]
    header, _, row = markdown_table(report).splitlines()
    assert header.startswith(
        "| prompt set | n | k | eagle3 (start) | eagle3.1 (start) | eagle3 | eagle3.1 "
        "| eagle3.1 / eagle3 | eagle3 / eagle3 (start) | eagle3.1 / eagle3.1 (start) |"
    )
    assert row.startswith("| chat | 2 | 3 | 1.40 | 1.50 | 1.60 | 1.80 | 1.12x | 1.14x | 1.20x |")


@pytest.mark.ray
def test_isolated_stage_runs_in_a_child_and_its_failure_is_raised(tmp_path):
    from specserve.drafter.pipeline import _isolated

    marker = tmp_path / "ran"
    _isolated(marker.write_text, "child")  # a vLLM stage's engines end with this child process
    assert marker.read_text() == "child"
    with pytest.raises(RuntimeError, match="exit code 3"):
        _isolated(sys.exit, 3)


def test_answers_are_reused_by_prompt_and_only_new_prompts_are_answered():
    from specserve.drafter.data import reuse_answers

    def prompt(i: int) -> Prompt:
        messages = [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": ""},  # written by the target, turn by turn
            {"role": "user", "content": "And then?"},
        ]
        return Prompt("chat", messages)

    def row(i: int) -> dict:
        messages = [dict(m) for m in prompt(i).messages]
        messages[1]["content"] = f"first answer {i}"
        return {"kind": "chat", "messages": [*messages, {"role": "assistant", "content": "a"}]}

    old = [row(3), row(1), row(2)]
    kept, missing = reuse_answers(old, [prompt(i) for i in (1, 2, 3, 4, 5)])
    assert kept == old  # the old order: their captured shards stay valid
    assert [p.messages[0]["content"] for p in missing] == ["q4", "q5"]
    kept, missing = reuse_answers(old, [prompt(1), prompt(3)])
    assert kept == [row(3), row(1)] and missing == []


def test_shards_cut_by_content_so_a_dropped_row_changes_only_its_own_shard():
    from specserve.drafter.data import SHARD_SEQUENCES, shard_groups

    rows = [
        {"kind": "chat", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3000)
    ]
    groups = shard_groups(rows)
    assert [row for group in groups for row in group] == rows  # every row once, in order
    assert max(len(group) for group in groups) <= 2 * SHARD_SEQUENCES
    assert 3000 / SHARD_SEQUENCES / 2 < len(groups) < 3000 / SHARD_SEQUENCES * 2

    middle = next(i for i, group in enumerate(groups) if 0 < i < len(groups) - 1)
    dropped = groups[middle][0]
    after = shard_groups([row for row in rows if row is not dropped])
    changed = [group for group in after if group not in groups]
    assert len(after) == len(groups) and changed == [groups[middle][1:]]


def test_foreign_templates_render_every_turn_and_end_ready_for_the_answer():
    from specserve.drafter.prompts import FOREIGN_TEMPLATES, render

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert render(messages, "alpaca") == "Be brief.\n\n### Instruction:\nHi?\n\n### Response:\n"
    assert render(messages[1:], "plain") == "User: Hi?\nAssistant:"
    for name in FOREIGN_TEMPLATES:  # never the target's own ChatML roles
        assert "<|im_start|>user" not in render(messages, name)


def test_signatures_hide_addresses_and_process_state():
    import difflib
    import os
    import smtplib

    from specserve.drafter.prompts import signature

    assert signature(difflib.ndiff) == "(a, b, linejunk=None, charjunk=...)"  # a function
    assert " at 0x" not in signature(smtplib.SMTP)  # timeout=<object object at 0x...>

    def uses_environ(environ=os.environ, n=3):
        pass

    assert signature(uses_environ) == "(environ=..., n=3)"
    assert signature(len) == "(obj, /)"


def test_length_ratio_interval_is_paired_over_prompts():
    from specserve.drafter.evaluate import Acceptance, length_ratio, markdown_table

    def row(name: str, accepted: list[int]) -> dict:
        per_prompt = [[10, a] for a in accepted]
        total = sum(accepted)
        return Acceptance(
            name,
            3,
            "long",
            len(accepted),
            10 * len(accepted),
            30 * len(accepted),
            total,
            [total, 0, 0],
            per_prompt,
        ).to_dict()

    # Prompts differ a lot in difficulty, but the variant accepts 2 more on every one of them.
    easy_and_hard = [1, 9, 2, 8, 1, 9, 3, 7, 2, 8]
    base, better = row("eagle3", easy_and_hard), row("eagle3.1", [a + 2 for a in easy_and_hard])
    point, low, high = length_ratio(better, base)
    assert point == pytest.approx(1.7 / 1.5) and 1.0 < low < point < high
    same_point, same_low, same_high = length_ratio(base, row("eagle3", easy_and_hard))
    assert same_low == same_point == same_high == 1.0  # identical per prompt: no spread
    assert f"| {point:.2f}x ({low:.2f}-{high:.2f}) |" in markdown_table([base, better])
    del better["per_prompt"]  # an older report: the ratio without an interval
    assert "| 1.13x | 0.70" in markdown_table([base, better])


def test_validation_curves_are_plotted_from_each_trainers_history(tmp_path):
    from specserve.drafter.pipeline import plot_validation

    for name, chain in (("eagle3", 0.3), ("eagle3.1", 0.4)):
        history = [
            {"update": u, "chain": [chain * u / 500, 0.1], "step_top1": []} for u in (250, 500)
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "validation.json").write_text(json.dumps(history))
    out = plot_validation(tmp_path, ["eagle3", "eagle3.1", "never-trained"])
    assert out == tmp_path / "validation.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_a_build_continuing_from_a_missing_drafter_stops_before_any_work(tmp_path):
    from specserve.drafter.pipeline import PipelineConfig, run

    (tmp_path / "start" / "eagle3").mkdir(parents=True)
    (tmp_path / "start" / "eagle3" / "config.json").write_text("{}")
    config = PipelineConfig(tmp_path / "work", "no-target", init_from=tmp_path / "start")
    with pytest.raises(FileNotFoundError, match=r"no exported drafter in .*start/eagle3\.1$"):
        run(config)
    assert not (tmp_path / "work").exists()


def test_a_build_on_existing_answers_without_any_stops_before_generating(tmp_path):
    from specserve.drafter.pipeline import PipelineConfig, run

    config = PipelineConfig(tmp_path / "work", "no-target", existing_answers=True)
    with pytest.raises(FileNotFoundError, match=r"--existing-answers: .*work/answers\.jsonl"):
        run(config)
    assert list((tmp_path / "work").iterdir()) == []  # no questions, no answers written


def _stage_with_an_engine(pids: Path) -> None:
    """Stands in for a vLLM stage: a daemonic child of its own (the engine core), then waits."""
    engine = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    engine.daemon = True
    engine.start()
    pids.write_text(f"{os.getpid()} {engine.pid}")
    time.sleep(600)


@pytest.mark.ray
def test_a_killed_build_takes_its_stage_and_the_stages_engine_with_it(tmp_path):
    pids = tmp_path / "pids"
    build = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path;"
            " from specserve.drafter.pipeline import _isolated;"
            " from tests.unit.test_drafter_pipeline import _stage_with_an_engine;"
            " _isolated(_stage_with_an_engine, Path(sys.argv[1]))",
            str(pids),
        ],
        cwd=Path(__file__).resolve().parents[2],
    )
    deadline = time.monotonic() + 60
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.monotonic() < deadline and build.poll() is None, "the stage did not start"
        time.sleep(0.2)
    stage, engine = (psutil.Process(int(pid)) for pid in pids.read_text().split())
    build.kill()  # SIGKILL: the build gets no chance to clean up
    build.wait()
    _, alive = psutil.wait_procs([stage, engine], timeout=20)
    assert alive == [], f"still running after the build was killed: {alive}"
