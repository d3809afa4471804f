"""bench/step_log.py reads vLLM's per-step lines from Ray's worker logs, per arm."""

from __future__ import annotations

import json

from specserve.bench import step_log

# The lines as an arm's replica writes them (copied from a served engine's worker log).
HEADER = ":job_id:01000000\n:actor_name:ServeReplica:arm-{arm}:arm-{arm}\n"
LINE = (
    "(MainProcess pid=16202) INFO 12-06 19:59:55 [loggers.py:199] Engine 000: Iteration({i}): "
    "{cr} context requests, {ct} context tokens, {gr} generation requests, {gt} generation "
    "tokens, iteration elapsed time: {ms} ms, CPU KV cache usage: 0.3%\n"
)


def worker_log(tmp_path, name: str, arm: str | None, steps: list[tuple]) -> None:
    text = HEADER.format(arm=arm) if arm else ":job_id:01000000\n:actor_name:ProxyActor\n"
    for i, (cr, ct, gr, gt, ms) in enumerate(steps):
        text += LINE.format(i=i, cr=cr, ct=ct, gr=gr, gt=gt, ms=ms)
        text += "unrelated line\n"
    (tmp_path / f"worker-{name}.out").write_text(text)


def test_steps_are_read_per_arm_and_other_workers_are_left_out(tmp_path):
    worker_log(tmp_path, "a-1", "eagle3.1", [(1, 32, 0, 0, 399.0), (0, 0, 1, 4, 128.5)])
    worker_log(tmp_path, "b-2", "no-spec", [(1, 32, 0, 0, 278.0)])
    worker_log(tmp_path, "c-3", None, [(0, 0, 1, 1, 50.0)])
    arms = step_log.arm_steps(tmp_path)
    assert sorted(arms) == ["eagle3.1", "no-spec"]
    assert arms["eagle3.1"] == [
        step_log.Step(1, 32, 0, 0, 399.0),
        step_log.Step(0, 0, 1, 4, 128.5),
    ]


def test_decode_steps_are_grouped_by_requests_and_tokens_from_the_first_full_step():
    steps = [step_log.Step(0, 0, 4, 16, 60.0)]  # before the level: left out
    steps += [step_log.Step(15, 543, 1, 4, 2102.0)]  # the level's first step, with a prefill
    steps += [step_log.Step(0, 0, 16, 16, ms) for ms in (180.0, 190.0, 200.0)]
    steps += [step_log.Step(0, 0, 16, 32, 250.0)]
    summary = step_log.summarise(steps, from_requests=16)
    assert summary["steps"] == 5
    assert summary["prefill_steps"] == 1 and summary["context_tokens"] == 543
    assert summary["decode"] == [
        {"requests": 16, "tokens_per_request": 1, "steps": 3, "median_ms": 190.0},
        {"requests": 16, "tokens_per_request": 2, "steps": 1, "median_ms": 250.0},
    ]
    assert abs(summary["seconds"] - 2.922) < 1e-9


def test_the_command_writes_its_summary_and_says_what_to_set_when_nothing_is_logged(
    tmp_path, capsys
):
    assert step_log.main(["--logs", str(tmp_path)]) == 1
    assert "enable_logging_iteration_details" in capsys.readouterr().err
    worker_log(tmp_path, "a-1", "eagle3", [(0, 0, 2, 6, 121.0)] * 3)
    out = tmp_path / "steps.json"
    assert step_log.main(["--logs", str(tmp_path), "--min-steps", "3", "--json", str(out)]) == 0
    assert "| eagle3 | 3 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["eagle3"]["decode"][0]["tokens_per_request"] == 3
