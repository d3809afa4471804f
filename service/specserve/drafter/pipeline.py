"""`make drafters`: data, both trainings, export and evaluation, resuming where it stopped.

Every stage writes its result under the work directory and is skipped when that result exists;
training resumes from its own checkpoint. EAGLE-3 and EAGLE-3.1 get the same data, draft
vocabulary, steps and seed, so the comparison is fair.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specserve.drafter.prompts import Prompt, build_prompts
from specserve.models import PACKAGED_DRAFTERS_DIR

VARIANTS = {"eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True}}


@dataclass
class PipelineConfig:
    work_dir: Path
    target_dir: str
    max_train_prompts: int = 3000
    max_answer_tokens: int = 256
    draft_vocab_size: int = 8192
    eval_prompts_per_set: int = 24
    ship: bool = False


def _log(message: str) -> None:
    print(f"[drafters {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(config: PipelineConfig, train_config=None) -> dict:
    from specserve.drafter.data import capture_features, generate_answers
    from specserve.drafter.model import DrafterConfig
    from specserve.drafter.train import TrainConfig, load_records, new_drafter, train

    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    train_config = train_config or TrainConfig()

    answers = work / "answers.jsonl"
    if not answers.exists():
        prompts = build_prompts(held_out=False)[: config.max_train_prompts]
        _log(f"generating answers for {len(prompts)} training prompts")
        generate_answers(prompts, config.target_dir, answers, max_tokens=config.max_answer_tokens)

    from transformers import AutoConfig

    aux_layers = DrafterConfig.for_target(
        AutoConfig.from_pretrained(config.target_dir)
    ).aux_layer_ids
    _log("capturing target hidden states")
    shards = capture_features(answers, config.target_dir, work / "features", aux_layers)
    records = load_records(shards)
    _log(f"{len(records)} sequences, {sum(r['input_ids'].numel() for r in records)} tokens")

    exported = {}
    for name, switches in VARIANTS.items():
        out = work / name
        if not (out / "export" / "config.json").exists():
            model = new_drafter(
                config.target_dir, records, draft_vocab_size=config.draft_vocab_size, **switches
            )
            train(model, records, out, replace(train_config), desc=f"train {name}")
            model.export(out / "export")
        exported[name] = str(out / "export")

    report = work / "eval.json"
    if not report.exists():
        from specserve.drafter.evaluate import evaluate, write_report

        sets = eval_sets(config.eval_prompts_per_set)
        _log(f"evaluating on {', '.join(f'{k} ({len(v)})' for k, v in sets.items())}")
        results = evaluate(config.target_dir, exported, sets)
        write_report(results, report)
    if config.ship:
        for name, path in exported.items():
            dest = PACKAGED_DRAFTERS_DIR / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(path, dest)
            _log(f"shipped {name} -> {dest}")
    return json.loads(report.read_text())


def eval_sets(per_set: int) -> dict[str, list[list[dict]]]:
    """Held-out prompt sets: chat, coding, long context (>= 2,000 tokens), perturbed templates."""
    held_out = build_prompts(held_out=True)
    by_kind: dict[str, list[Prompt]] = {}
    for p in held_out:
        by_kind.setdefault(p.kind, []).append(p)
    wanted = {"chat": "chat", "code": "coding", "long": "long", "perturbed": "perturbed"}
    return {
        label: [p.messages for p in by_kind.get(kind, [])[:per_set]]
        for kind, label in wanted.items()
    }
