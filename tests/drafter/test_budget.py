"""`drafter build --budget`: the torch-only build (answers, hidden states, both drafters,
scores) on a tiny target, in a tiny budget on the CPU: the path a GPU machine runs."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from specserve.drafter import budget
from specserve.drafter.model import VARIANTS, Drafter
from specserve.drafter.train import TrainConfig


def prompts(path):
    rows = [
        {"split": "train", "kind": "chat", "messages": [{"role": "user", "content": f"Say {i}."}]}
        for i in range(24)
    ]
    rows += [
        {
            "split": "held_out",
            "kind": kind,
            "messages": [{"role": "user", "content": f"{kind} {i}"}],
        }
        for kind in ("chat", "coding")
        for i in range(6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_run(target, prompts_file, work, updates, compare):
    return budget.run(
        target,
        prompts_file,
        work,
        minutes=3,
        device=torch.device("cpu"),
        updates=updates,
        max_new_tokens=24,
        compare=compare,
        draft_vocab_size=512,
        train_config=TrainConfig(tokens_per_update=64, lr=3e-3),
    )


@pytest.mark.e2e
def test_a_tiny_budget_runs_every_stage_and_scores_beside_the_compared_pair(tiny_target, tmp_path):
    first = tiny_run(tiny_target, prompts(tmp_path / "prompts.jsonl"), tmp_path / "first", 30, None)
    assert first["answered"] == 36 and first["sequences"]["training"] > 0
    assert set(first["stages_s"]) == {"answers", "hidden states", "training", "scoring"}
    assert all(0 < n <= 30 for n in first["updates"].values())
    assert all(0 < first["updates_done"][k] <= n for k, n in first["updates"].items())
    for name in VARIANTS:
        export = Drafter.from_pretrained(first["exports"][name])
        assert export.config.fc_norm == (name == "eagle3.1")
    assert {r["set"] for r in first["scores"]} == {"chat", "coding"}
    assert first["better_than_compared"] is None

    # `score` on the exports: the run's own scores, from the same greedy answers.
    exports = [Path(first["exports"][name]) for name in VARIANTS]
    rescored = budget.score_exports(
        tiny_target,
        tmp_path / "prompts.jsonl",
        exports,
        sets=["chat"],
        device=torch.device("cpu"),
        max_new_tokens=24,
    )
    by_run = {r["drafter"]: r["acceptance_length"] for r in first["scores"] if r["set"] == "chat"}
    assert {r["drafter"]: r["acceptance_length"] for r in rescored} == pytest.approx(
        {str(Path(first["exports"][name])): by_run[name] for name in VARIANTS}
    )

    pair = tmp_path / "pair"  # compare a second run against the first's exports
    for name in VARIANTS:
        shutil.copytree(first["exports"][name], pair / name)
    second = tiny_run(tiny_target, tmp_path / "prompts.jsonl", tmp_path / "second", 10, pair)
    drafters = {r["drafter"] for r in second["scores"]}
    assert drafters == {*VARIANTS, "eagle3 (pair)", "eagle3.1 (pair)"}
    assert set(second["better_than_compared"]) == set(VARIANTS)
    assert json.loads((tmp_path / "second" / "report.json").read_text())["updates"]
    assert "| eagle3 (pair) |" in budget.markdown(second)


def test_budgets_name_a_device_and_minutes():
    assert budget.parse_budget("gpu-10min") == ("cuda", 10.0)
    assert budget.parse_budget("cpu-2.5min") == ("cpu", 2.5)
    with pytest.raises(ValueError, match="gpu-10min"):
        budget.parse_budget("10 minutes")
