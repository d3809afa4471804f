"""The whole drafter build in a fixed time on one device, with torch and transformers alone.

    python -m specserve.drafter.budget prompts --out prompts.jsonl     # once, where specserve runs
    python -m specserve.drafter.budget run --target DIR --prompts prompts.jsonl \\
        --work DIR --minutes 10 --device cuda                          # on the GPU machine
    specserve drafter build --budget gpu-10min       # both, with the configured target

What a machine with a GPU and nothing but torch, transformers and safetensors can run (no vLLM,
no Ray, nothing downloaded): the prompts come as a file (`prompts`: the build's training mix and
held-out sets, which need man pages and the standard library's sources to make), the target as
its prepared directory. Each stage takes its share of the budget:

1. answers (30 %): the target answers the training prompts and the held-out ones greedily, in
   padded batches (`generate`, left padding, sorted by length); when its share is spent it
   takes no new batch and the build goes on with the answers it has;
2. hidden states (10 %): `features_batched` over every answered sequence;
3. training (50 %, and whatever the first two stages left unused): EAGLE-3 and EAGLE-3.1 in
   turn with the same data, vocabulary and seed, the batched trainer, the recipe's long budget
   of answer tokens or fewer: a probe of 20 updates measures the rate and the count is cut to
   fit each drafter's half, and its share's end is a deadline. On a GPU an update holds 8x the
   CPU recipe's answer tokens at ~2.8x its learning rate (`RECIPES`, the square-root rule):
   512-token updates leave it idle;
4. export (vLLM's format) and scoring (5 %): offline acceptance (greedy drafting simulated on
   the target's own states) at k = 3 on each held-out set, beside the pair it is compared with
   (default: the shipped one) on the same sequences; `report.json` says which is better.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.drafter.model import VARIANTS, Drafter
from specserve.drafter.train import (
    TrainConfig,
    new_drafter,
    offline_acceptance,
    resident,
    split_validation,
    target_weights,
    train,
)

SHARES = {"answers": 0.30, "features": 0.10, "training": 0.50, "scoring": 0.05}
LONG_BUDGET_UPDATES = 15_000  # the recipe's long run (docs/drafters.md), in its 512-token updates
# Per device, what differs from `TrainConfig`'s recipe: on a GPU bigger updates (the square-root
# rule for the learning rate), so the long budget's answer tokens fit minutes, not hours.
# An H200 takes 14.5 updates/s at 2,048 answer tokens and 13.6 at 4,096 (docs/bench/trainer.md):
# 4,096 fits the long budget's tokens (1,875 updates) in ~2.5 minutes per drafter.
RECIPES: dict[str, dict[str, Any]] = {"cuda": {"tokens_per_update": 4096, "lr": 2.8e-3}, "cpu": {}}
EVAL_K = 3
VALIDATIONS = 11  # in a run: where it starts, then every tenth of its updates
HELD_OUT_SETS = {"chat": "chat", "code": "coding", "long": "long", "perturbed": "perturbed"}
PACKAGED = Path(__file__).resolve().parents[1] / "drafters"  # the shipped pair


def _log(message: str) -> None:
    print(f"[budget {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- prompts ----------------------------------------------------------------------------------


def write_prompts(out: Path, train_prompts: int = 2600, per_set: int = 24) -> Path:
    """The build's training mix (first turns) and held-out sets as JSONL rows
    {split, kind, messages}: everything `run` needs that cannot be made on a bare machine."""
    from specserve.drafter.pipeline import training_mix
    from specserve.drafter.prompts import build_prompts, first_turn

    rows = [
        {"split": "train", "kind": p.kind, "messages": first_turn(p.messages)}
        for p in training_mix(build_prompts(held_out=False), train_prompts)
    ]
    by_kind: dict[str, list] = {}
    for p in build_prompts(held_out=True):
        by_kind.setdefault(p.kind, []).append(p)
    for kind, label in HELD_OUT_SETS.items():
        rows += [
            {"split": "held_out", "kind": label, "messages": first_turn(p.messages)}
            for p in by_kind.get(kind, [])[:per_set]
        ]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


# -- the stages -------------------------------------------------------------------------------


def generate_answers(
    target_dir: str,
    rows: list[dict],
    device: torch.device,
    *,
    max_new_tokens: int,
    batch_size: int,
    seconds: float,
) -> list[dict]:
    """Greedy answers of the target to each row's messages, in padded batches (shortest
    prompts first), until `seconds` are spent: -> rows with `prompt_token_ids` and
    `output_token_ids` (up to and with the end-of-turn token), as a serving engine records
    them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    prompts = [
        list(_ids(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)))
        for r in rows
    ]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    deadline = time.monotonic() + seconds
    answered: list[dict] = []
    batches = range(0, len(order), batch_size)
    for start in tqdm(batches, desc="answers", unit="batch", disable=len(batches) < 2):
        if time.monotonic() > deadline:
            _log(f"answers: the share is spent after {len(answered)} of {len(rows)} prompts")
            break
        batch = order[start : start + batch_size]
        longest = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for b, i in enumerate(batch):  # left padding: every prompt ends where generation starts
            ids[b, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[b, longest - len(prompts[i]) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        for b, i in enumerate(batch):
            new = out[b, longest:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            answered.append({**rows[i], "prompt_token_ids": prompts[i], "output_token_ids": new})
    del model
    return answered


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        return list(encoded["input_ids"])
    return list(encoded)


def hidden_states(
    target_dir: str, rows: list[dict], device: torch.device, layers: tuple[int, ...]
) -> list[dict]:
    """Each answered row's record (token ids, captured states, answer start, kind)."""
    from transformers import AutoModelForCausalLM

    from specserve.drafter.data import features_batched

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    sequences = [
        (r["prompt_token_ids"] + r["output_token_ids"], len(r["prompt_token_ids"])) for r in rows
    ]
    records = []
    for row, record in zip(rows, features_batched(model, sequences, layers), strict=True):
        if record is not None:
            records.append({**record, "kind": row["kind"], "split": row["split"]})
    del model
    return records


def fit_updates(
    model: Drafter,
    records: list[dict],
    out: Path,
    config: TrainConfig,
    seconds: float,
    *,
    validation: list[dict] | None = None,
    probe: int = 20,
    warmup: int = 10,
) -> int:
    """Updates that fit `seconds`, less what this probe takes and the run's validations, at the
    rate `probe` updates measure after `warmup` untimed ones (the device's first updates pay
    its start-up), on a copy of the model in a directory of its own; at most `config.updates`.
    A tenth is kept for the export and the rate's noise."""
    import copy

    started = time.monotonic()
    trial = copy.deepcopy(model)
    quiet = replace(config, checkpoint_every=1 << 30, validate_every=1 << 30)
    train(trial, records, out / "warm-up", replace(quiet, updates=warmup), desc="warm-up")
    timed = time.monotonic()
    train(trial, records, out / "probe", replace(quiet, updates=probe), desc="probe")
    per_update = (time.monotonic() - timed) / probe
    per_validation = 0.0
    if validation:
        timed = time.monotonic()
        offline_acceptance(trial, validation, config.steps, config.batch_tokens)
        per_validation = time.monotonic() - timed
    left = seconds - (time.monotonic() - started) - VALIDATIONS * per_validation
    fitting = max(probe, int(0.9 * left / per_update))
    _log(
        f"{per_update * 1000:.0f} ms per update, {per_validation:.1f} s per validation: "
        f"{fitting} updates fit the share"
    )
    return min(config.updates, fitting)


def score(
    drafters: dict[str, Drafter], held_out: list[dict], k: int = EVAL_K
) -> list[dict[str, Any]]:
    """Offline acceptance length at k of every drafter on every held-out set."""
    rows = []
    for kind in sorted({r["kind"] for r in held_out}):
        sequences = [r for r in held_out if r["kind"] == kind]
        for name, model in drafters.items():
            result = offline_acceptance(model, sequences, k)
            rows.append(
                {
                    "drafter": name,
                    "set": kind,
                    "sequences": len(sequences),
                    "tokens": result.tokens,
                    "acceptance_length": result.mean_acceptance_length,
                    "chain": result.chain,
                }
            )
    return rows


def score_exports(
    target_dir: str,
    prompts: Path,
    exports: list[Path],
    *,
    sets: list[str],
    device: torch.device,
    max_new_tokens: int = 256,
) -> list[dict[str, Any]]:
    """Offline acceptance at k = 3 of exported drafters (named by their paths) on the held-out
    prompts of `sets`, answered by the target here: the `run`'s scoring for drafters made
    elsewhere, on the same sequences for all."""
    from transformers import AutoConfig

    from specserve.drafter.model import DrafterConfig

    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == "held_out" and r["kind"] in sets]
    batch = 256 if device.type == "cuda" else 16
    answered = generate_answers(
        target_dir,
        rows,
        device,
        max_new_tokens=max_new_tokens,
        batch_size=batch,
        seconds=float("inf"),
    )
    layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target_dir)).aux_layer_ids
    records = hidden_states(target_dir, answered, device, layers)
    embed = target_weights(target_dir)["embed"]
    drafters = {str(p): Drafter.from_pretrained(p, embed).to(device) for p in exports}
    return score(drafters, records)


def run(
    target_dir: str,
    prompts: Path,
    work: Path,
    *,
    minutes: float,
    device: torch.device,
    updates: int = LONG_BUDGET_UPDATES,
    max_new_tokens: int = 256,
    generation_batch: int | None = None,
    compare: Path | None = PACKAGED,
    draft_vocab_size: int = 8192,
    train_config: TrainConfig | None = None,
    recipe: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The four stages (module docstring) within `minutes`; -> the report (`work/report.json`)."""
    from transformers import AutoConfig

    from specserve.drafter.model import DrafterConfig

    started = time.monotonic()
    budget = minutes * 60
    if device.type == "cuda":  # batches change shape at every forward: grow, don't fragment
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target_dir)).aux_layer_ids
    timings: dict[str, float] = {}

    def stage(name: str, since: float) -> None:
        timings[name] = round(time.monotonic() - since, 1)
        _log(f"{name}: {timings[name]:.0f} s")

    t = time.monotonic()
    batch = generation_batch or (256 if device.type == "cuda" else 16)
    answered = generate_answers(
        target_dir,
        rows,
        device,
        max_new_tokens=max_new_tokens,
        batch_size=batch,
        seconds=SHARES["answers"] * budget,
    )
    stage("answers", t)

    t = time.monotonic()
    records = hidden_states(target_dir, answered, device, layers)
    training, validation = split_validation([r for r in records if r["split"] == "train"])
    held_out = [r for r in records if r["split"] == "held_out"]
    stage("hidden states", t)
    _log(
        f"{len(training)} training and {len(validation)} validation sequences "
        f"({sum(r['input_ids'].numel() - r['answer_start'] for r in training)} answer tokens), "
        f"{len(held_out)} held out"
    )

    t = time.monotonic()
    config = train_config
    if config is None:  # the device's recipe, for the long budget's answer tokens
        config = TrainConfig(**{**RECIPES.get(device.type, {}), **(recipe or {})})
        updates = max(1, updates * TrainConfig.tokens_per_update // config.tokens_per_update)
    config = replace(config, updates=updates)
    # Once, where training runs: the probe, the run and every validation then collate there.
    t_copy = time.monotonic()
    on_device = resident(training, device, finals=config.soft_labels > 0)
    validating = resident(validation, device, finals=False)
    if on_device is not training:
        gib = sum(t.nbytes for r in on_device for t in r.values() if torch.is_tensor(t)) / 2**30
        _log(f"captured states on {device}: {gib:.1f} GiB in {time.monotonic() - t_copy:.1f} s")
    trained: dict[str, Drafter] = {}
    fitted: dict[str, int] = {}
    done: dict[str, int] = {}  # fewer than fitted where the deadline came first
    training_ends = started + (1 - SHARES["scoring"]) * budget
    for i, (name, switches) in enumerate(VARIANTS.items()):
        t_drafter = time.monotonic()
        per_drafter = (training_ends - t_drafter) / (len(VARIANTS) - i)
        model = new_drafter(target_dir, training, draft_vocab_size=draft_vocab_size, **switches)
        model = model.to(device)
        out = work / name
        left = per_drafter - (time.monotonic() - t_drafter)
        fitted[name] = fit_updates(model, on_device, out, config, left, validation=validating)
        run_config = replace(
            config,
            updates=fitted[name],
            validate_every=max(1, fitted[name] // 10),
            checkpoint_every=max(1, fitted[name] // 4),
        )
        # The probe's rate is an estimate: the share's end is a deadline, whatever it says.
        deadline = t_drafter + per_drafter
        t_train = time.monotonic()
        train(
            model,
            on_device,
            out,
            run_config,
            validation=validating,
            desc=f"train {name}",
            deadline=deadline,
        )
        done[name] = _updates_done(out, fitted[name])
        _log(f"{name}: {done[name]} updates in {time.monotonic() - t_train:.0f} s{_memory(device)}")
        model.cpu().export(out / "export")
        trained[name] = model.to(device)
    stage("training", t)

    t = time.monotonic()
    drafters = dict(trained)
    if compare is not None:
        embed = target_weights(target_dir)["embed"]
        for name in VARIANTS:
            if (compare / name / "config.json").exists():
                drafters[f"{name} ({compare.name})"] = Drafter.from_pretrained(
                    compare / name, embed
                ).to(device)
    scores = score(drafters, held_out) if held_out else []
    stage("scoring", t)

    report = {
        "device": str(device),
        "minutes_budget": minutes,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "stages_s": timings,
        "prompts": len(rows),
        "answered": len(answered),
        "sequences": {"training": len(training), "validation": len(validation)},
        "updates": fitted,
        "updates_done": done,
        "train_config": asdict(config),
        "exports": {name: str(work / name / "export") for name in trained},
        "scores": scores,
        "better_than_compared": _better(scores, list(VARIANTS), compare),
    }
    (work / "report.json").write_text(json.dumps(report, indent=1))
    _log(f"done in {report['minutes']:.1f} min; report: {work / 'report.json'}")
    return report


def _memory(device: torch.device) -> str:
    """A GPU's peak memory and allocator retries (each one frees the cache and waits)."""
    if device.type != "cuda":
        return ""
    stats = torch.cuda.memory_stats(device)
    peak = stats.get("allocated_bytes.all.peak", 0) / 2**30
    return f", peak {peak:.1f} GiB, {stats.get('num_alloc_retries', 0)} allocator retries"


def _updates_done(out: Path, planned: int) -> int:
    """The update of the run's last validation (`train` validates where it stops)."""
    history = out / "validation.json"
    if not history.exists():
        return planned
    return json.loads(history.read_text())[-1]["update"]


def _better(scores: list[dict], names: list[str], compare: Path | None) -> dict[str, bool] | None:
    """Per variant: higher acceptance than the compared drafter of its kind on every set."""
    if compare is None:
        return None
    table = {(r["drafter"], r["set"]): r["acceptance_length"] for r in scores}
    found = {}
    for name in names:
        other = f"{name} ({compare.name})"
        sets = [s for (d, s) in table if d == name and (other, s) in table]
        if sets:
            found[name] = all(table[(name, s)] > table[(other, s)] for s in sets)
    return found


def markdown(report: dict[str, Any]) -> str:
    sets = sorted({r["set"] for r in report["scores"]})
    drafters = list(dict.fromkeys(r["drafter"] for r in report["scores"]))
    table = {(r["drafter"], r["set"]): r["acceptance_length"] for r in report["scores"]}
    lines = [
        f"| drafter | {' | '.join(sets)} |",
        "| --- |" + " --- |" * len(sets),
    ]
    for d in drafters:
        lines.append(f"| {d} | " + " | ".join(f"{table[(d, s)]:.3f}" for s in sets) + " |")
    return "\n".join(lines)


def parse_budget(text: str) -> tuple[str, float]:
    """`gpu-10min` -> ("cuda", 10.0); `cpu-30min` -> ("cpu", 30.0)."""
    import re

    match = re.fullmatch(r"(gpu|cpu)-(\d+(?:\.\d+)?)min", text)
    if not match:
        raise ValueError(f"--budget {text!r}: expected DEVICE-MINUTESmin, e.g. gpu-10min")
    return ("cuda" if match[1] == "gpu" else "cpu"), float(match[2])


def build_command(args: argparse.Namespace, target: str) -> int:
    """`drafter build --budget gpu-10min`: the torch-only build within a time budget."""
    from specserve.config.settings import get_settings

    try:
        device, minutes = parse_budget(args.budget)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "error: no GPU here: --budget cpu-MINUTESmin runs the same path on the CPU",
            file=sys.stderr,
        )
        return 2
    work = args.work_dir or get_settings().cache_dir / f"drafters-{args.budget}"
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, args.prompts)
    updates = args.updates or LONG_BUDGET_UPDATES
    report = run(
        target, prompts, work, minutes=minutes, device=torch.device(device), updates=updates
    )
    print(markdown(report))
    better = report["better_than_compared"] or {}
    if args.ship:
        from specserve.models import PACKAGED_DRAFTERS_DIR

        for name, is_better in better.items():
            if is_better:
                shutil.rmtree(PACKAGED_DRAFTERS_DIR / name, ignore_errors=True)
                shutil.copytree(report["exports"][name], PACKAGED_DRAFTERS_DIR / name)
                print(f"shipped {name}: better than the shipped one on every held-out set")
            else:
                print(f"kept the shipped {name}: the new one is not better on every set")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prompts_p = sub.add_parser("prompts", help="write the training and held-out prompts")
    prompts_p.add_argument("--out", type=Path, required=True)
    prompts_p.add_argument("--train-prompts", type=int, default=2600)
    prompts_p.add_argument("--per-set", type=int, default=24, help="held-out prompts per set")
    # What `score` and `run` both take: the target, the prompts, the device, answer lengths.
    answering = argparse.ArgumentParser(add_help=False)
    answering.add_argument("--target", required=True, help="the prepared target's directory")
    answering.add_argument("--prompts", type=Path, required=True, help="from `prompts`")
    answering.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    answering.add_argument("--max-new-tokens", type=int, default=256)
    score_p = sub.add_parser(
        "score", parents=[answering], help="exported drafters side by side on held-out prompts"
    )
    score_p.add_argument("--drafters", type=Path, nargs="+", required=True, help="exports")
    score_p.add_argument("--sets", nargs="+", default=list(HELD_OUT_SETS.values()))
    run_p = sub.add_parser(
        "run", parents=[answering], help="answers, hidden states, both drafters, scores"
    )
    run_p.add_argument("--work", type=Path, required=True)
    run_p.add_argument("--minutes", type=float, default=10.0)
    run_p.add_argument("--updates", type=int, default=LONG_BUDGET_UPDATES, help="at most")
    run_p.add_argument("--tokens-per-update", type=int, help="default: the device's recipe")
    run_p.add_argument("--lr", type=float, help="default: the device's recipe")
    run_p.add_argument(
        "--compare", default=str(PACKAGED), help="a pair to score beside ('none': score alone)"
    )
    args = parser.parse_args(argv)
    if args.command == "prompts":
        print(write_prompts(args.out, args.train_prompts, args.per_set))
        return 0
    if args.command == "score":
        rows = score_exports(
            args.target,
            args.prompts,
            args.drafters,
            sets=args.sets,
            device=torch.device(args.device),
            max_new_tokens=args.max_new_tokens,
        )
        print(markdown({"scores": rows}))
        return 0
    report = run(
        args.target,
        args.prompts,
        args.work,
        minutes=args.minutes,
        device=torch.device(args.device),
        updates=args.updates,
        max_new_tokens=args.max_new_tokens,
        compare=None if args.compare == "none" else Path(args.compare),
        recipe={
            k: v
            for k, v in (("tokens_per_update", args.tokens_per_update), ("lr", args.lr))
            if v is not None
        },
    )
    print(markdown(report))
    print(json.dumps({k: report[k] for k in ("minutes", "stages_s", "updates", "updates_done")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
