"""`make drafters`: data, both trainings, export and evaluation, resuming where it stopped.

Every stage writes its result under the work directory and is skipped when that result exists;
training resumes from its own checkpoint. EAGLE-3 and EAGLE-3.1 get the same data, draft
vocabulary, steps and seed, so the comparison is fair.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from specserve.drafter.evaluate import START
from specserve.drafter.model import VARIANTS
from specserve.drafter.prompts import (
    CHAT_TOPICS,
    Prompt,
    build_prompts,
    render,
    self_instruct_prompts,
    shuffled,
)
from specserve.drafter.train import split_validation
from specserve.models import PACKAGED_DRAFTERS_DIR

__all__ = ["VARIANTS", "split_validation"]  # where the build's callers have found them

# Share of each kind among training prompts. Long documents are few but cost ~10x the tokens.
TRAIN_MIX = {"chat": 0.40, "code": 0.30, "doc": 0.27, "long": 0.03}
ANSWER_CHUNK = 1024  # prompts answered between saves; several full generation batches


@dataclass
class PipelineConfig:
    work_dir: Path
    target_dir: str
    max_train_prompts: int = 2600
    max_answer_tokens: int = 256
    draft_vocab_size: int = 8192
    eval_prompts_per_set: int = 24
    eval_ks: tuple[int, ...] = (3, 5)
    ship: bool = False
    # Continue training from `<init_from>/<variant>` (e.g. the shipped pair) instead of from
    # scratch; the evaluation then scores the starting drafters beside the new ones.
    init_from: Path | None = None
    # Train on `answers.jsonl` as it stands instead of completing it to `max_train_prompts`.
    existing_answers: bool = False
    threads: int | None = None  # generation's CPU threads (default: every core)


def _log(message: str) -> None:
    print(f"[drafters {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(config: PipelineConfig, train_config=None) -> list[dict]:
    from specserve.drafter.data import capture_features
    from specserve.drafter.model import Drafter, DrafterConfig
    from specserve.drafter.train import (
        TrainConfig,
        load_records,
        new_drafter,
        target_weights,
        train,
    )

    if config.init_from:  # before an hour of data work, not after it
        missing = [n for n in VARIANTS if not (config.init_from / n / "config.json").exists()]
        if missing:
            raise FileNotFoundError(
                f"--init-from {config.init_from}: no exported drafter in "
                + ", ".join(str(config.init_from / n) for n in missing)
            )
    started = time.monotonic()
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    train_config = train_config or TrainConfig()

    answers = work / "answers.jsonl"
    if not config.existing_answers:
        _isolated(_self_distill, config)  # a no-op when every training prompt has its answer
    elif not answers.exists():
        raise FileNotFoundError(f"--existing-answers: {answers} does not exist")

    from transformers import AutoConfig

    aux_layers = DrafterConfig.for_target(
        AutoConfig.from_pretrained(config.target_dir)
    ).aux_layer_ids
    _log("capturing target hidden states")
    shards = capture_features(answers, config.target_dir, work / "features", aux_layers)
    records, validation = split_validation(load_records(shards))
    _log(
        f"{len(records)} training sequences, {sum(r['input_ids'].numel() for r in records)} "
        f"tokens; {len(validation)} validation sequences"
    )

    exported = {}
    # Read once for both drafters, and only when continuing (a new drafter reads its own).
    embed = target_weights(config.target_dir)["embed"] if config.init_from else None
    for name, switches in VARIANTS.items():
        out = work / name
        if not (out / "export" / "config.json").exists():
            model = (
                Drafter.from_pretrained(config.init_from / name, embed)
                if config.init_from
                else new_drafter(
                    config.target_dir,
                    records,
                    draft_vocab_size=config.draft_vocab_size,
                    **switches,
                )
            )
            head = (  # the target's weights are read again only when soft labels need them
                target_weights(config.target_dir)["head"][model.draft_ids()]
                if train_config.soft_labels
                else None
            )
            train(
                model,
                records,
                out,
                replace(train_config),
                validation=validation,
                target_head=head,
                desc=f"train {name}",
            )
            model.export(out / "export")
        exported[name] = str(out / "export")
    if config.init_from:  # side by side with where training started, on the same prompts
        exported = {
            **{name + START: str(config.init_from / name) for name in VARIANTS},
            **exported,
        }

    _log(f"validation curves: {plot_validation(work, list(VARIANTS))}")
    report = work / "eval.json"
    if not report.exists():
        del records, validation  # the evaluation's engines need the memory
        _isolated(_evaluate, config, exported, report)
    if config.ship:
        for name in VARIANTS:
            path = exported[name]
            dest = PACKAGED_DRAFTERS_DIR / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(path, dest)
            _log(f"shipped {name} -> {dest}")
    _log(f"done in {(time.monotonic() - started) / 60:.1f} min")
    return json.loads(report.read_text())


def plot_validation(work: Path, names: list[str]) -> Path:
    """Held-out offline acceptance length against updates, one line per drafter (from each
    trainer's `validation.json`), written to `<work>/validation.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        path = work / name / "validation.json"
        if path.exists():
            history = json.loads(path.read_text())
            lengths = [1 + sum(h["chain"]) for h in history]
            ax.plot([h["update"] for h in history], lengths, marker="o", label=name)
    ax.set_xlabel("update")
    ax.set_ylabel("offline mean acceptance length")
    ax.set_title("held-out validation sequences")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = work / "validation.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _isolated(stage, *args) -> None:
    """Run a vLLM stage in a child process, so its engines and their memory end with it."""
    process = multiprocessing.get_context("spawn").Process(
        target=_stage_child, args=(os.getpid(), stage, *args)
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{stage.__name__} failed (exit code {process.exitcode})")


_PR_SET_PDEATHSIG = 1  # prctl(2): a signal for this process when its parent dies


def _stage_child(parent: int, stage, *args) -> None:
    """A stage's process, which ends when the build does even if the build is killed (Linux):
    the kernel sends it SIGTERM, which unwinds it like Ctrl-C, so that its own children (vLLM's
    engine core) are stopped too instead of computing on for nobody."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the build died before the kernel was asked to tell
        raise SystemExit(128 + signal.SIGTERM)
    stage(*args)


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _self_distill(config: PipelineConfig) -> None:
    """Questions written by the target (self-instruct), then its answers to the training mix.

    Answers already in the work directory are kept (in their order) and only new prompts are
    answered, so a bigger `--prompts` adds data instead of silently reusing the old."""
    from specserve.drafter.data import (
        generate_answers,
        generate_questions,
        reuse_answers,
        shutdown,
        target_llm,
    )

    candidates = build_prompts(held_out=False)  # before any engine: the same in every run
    llm = None
    try:
        questions = config.work_dir / "questions.jsonl"
        if not questions.exists():
            llm = target_llm(config.target_dir, config.threads)
            _log(f"the target writes chat questions about {len(CHAT_TOPICS)} topics")
            generate_questions(llm, CHAT_TOPICS, questions)
        written = [json.loads(line) for line in questions.read_text().splitlines()]
        candidates += self_instruct_prompts(written)
        prompts = training_mix(candidates, config.max_train_prompts)

        answers = config.work_dir / "answers.jsonl"
        old = (
            [json.loads(line) for line in answers.read_text().splitlines()]
            if answers.exists()
            else []
        )
        rows, missing = reuse_answers(old, prompts)
        if rows != old:
            _write_rows(answers, rows)
        if missing:
            counts = ", ".join(f"{k} {sum(p.kind == k for p in missing)}" for k in TRAIN_MIX)
            _log(f"generating answers for {len(missing)} of {len(prompts)} prompts ({counts})")
            llm = llm or target_llm(config.target_dir, config.threads)
        for start in range(0, len(missing), ANSWER_CHUNK):  # saved chunk by chunk: resumable
            chunk = missing[start : start + ANSWER_CHUNK]
            rows += generate_answers(llm, chunk, max_tokens=config.max_answer_tokens)
            _write_rows(answers, rows)
            _log(f"answered {start + len(chunk)} of {len(missing)}")
    finally:
        if llm is not None:
            shutdown(llm)


def _write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)


def _evaluate(config: PipelineConfig, exported: dict[str, str], report: Path) -> None:
    from specserve.drafter.evaluate import evaluate, write_report

    sets = eval_sets(config.eval_prompts_per_set)
    _log(f"evaluating on {', '.join(f'{k} ({len(v)})' for k, v in sets.items())}")
    write_report(evaluate(config.target_dir, exported, sets, ks=config.eval_ks), report)


def built_records(work: Path | None = None) -> tuple[Path, str, list[dict], list[dict]]:
    """A build's work directory (default: the build's own), the embedded target's directory and
    the training and validation sequences of the build after its answer stage (the benchmarks'
    input); hidden states are captured where missing, as the build does."""
    from transformers import AutoConfig

    from specserve.config.settings import get_settings
    from specserve.drafter.data import capture_features
    from specserve.drafter.model import DrafterConfig
    from specserve.drafter.train import load_records
    from specserve.models import resolve_model_source

    work = work or get_settings().cache_dir / "drafters"
    if not (work / "answers.jsonl").exists():
        raise SystemExit(f"{work}/answers.jsonl missing: run `specserve drafter build` first")
    target = resolve_model_source("embedded://SmolLM2-135M-Instruct")
    layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target)).aux_layer_ids
    shards = capture_features(work / "answers.jsonl", target, work / "features", layers)
    records, validation = split_validation(load_records(shards))
    return work, target, records, validation


def training_mix(prompts: list[Prompt], total: int, seed: int = 0) -> list[Prompt]:
    """Up to `total` prompts, each kind taking its `TRAIN_MIX` share, in a seeded random order.
    A bigger `total` keeps every prompt a smaller one chose (its answers are reused)."""
    ordered = shuffled(prompts, f"mix:{seed}")
    chosen = []
    for kind, share in TRAIN_MIX.items():
        chosen += [p for p in ordered if p.kind == kind][: round(share * total)]
    return shuffled(chosen, f"mix-order:{seed}")


def variant_drafter(target_dir: str, records: list[dict], variant: str):
    """A new drafter of `variant` (a key of `VARIANTS`) with the build's draft vocabulary, as
    `make drafters` starts one: what the benchmarks and the data-parallel trainer train."""
    from specserve.drafter.train import new_drafter

    return new_drafter(
        target_dir,
        records,
        draft_vocab_size=PipelineConfig.draft_vocab_size,
        **VARIANTS[variant],
    )


# The held-out sets by name, each of one prompt kind (prompts.KINDS).
EVAL_SETS = {
    "chat": "chat",
    "coding": "code",
    "long": "long",
    "perturbed": "perturbed",
    "template": "template",
}


def eval_sets(per_set: int, names: Collection[str] = tuple(EVAL_SETS)) -> dict[str, list]:
    """Held-out prompt sets (`names`, all by default): chat, coding, long context (>= 2,000
    tokens), perturbed system prompts (conversations), and foreign chat templates (plain
    prompts, already rendered). Only the sources of the sets named are read."""
    unknown = set(names) - set(EVAL_SETS)
    if unknown:
        raise ValueError(f"unknown prompt sets {sorted(unknown)}; known: {', '.join(EVAL_SETS)}")
    held_out = build_prompts(held_out=True, kinds={EVAL_SETS[name] for name in names})
    by_kind: dict[str, list[Prompt]] = {}
    for p in held_out:
        by_kind.setdefault(p.kind, []).append(p)
    sets: dict[str, list] = {}
    for name in names:
        chosen = by_kind.get(EVAL_SETS[name], [])[:per_set]
        if name == "template":
            sets[name] = [render(p.messages, p.meta["template"]) for p in chosen]
        else:
            sets[name] = [p.messages for p in chosen]
    return sets
