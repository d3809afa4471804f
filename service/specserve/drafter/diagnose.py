"""`specserve drafter diagnose`: the mechanism EAGLE-3.1 targets, measured per draft step.

Attention drift: as drafting goes deeper, a drafter's attention may slide off the context (and
its first, "sink", tokens) onto its own earlier drafts, while the hidden state it feeds itself
grows step by step. EAGLE-3.1 normalizes each captured target state before `fc` and feeds the
post-norm state to the next step to stop both. For each drafter this measures, on held-out
prompts the target answers itself, at every draft step j:

- the share of attention mass on the context (step 0's keys), on the first SINK_TOKENS of it,
  and on the drafter's own earlier drafts (steps 1..j's keys at the same index);
- the RMS of the hidden state fed to step j + 1;
- depth extrapolation: acceptance at each draft position (all steps up to it right, the target's
  own greedy tokens) and acceptance given the previous position was accepted, up to `steps`,
  deeper than the drafters were trained for;
- copying: the share of answer tokens a prompt lookup predicts (what the `ngram` arm drafts:
  the token after the latest earlier occurrence of the longest suffix of LOOKUP_NGRAM tokens),
  and the first draft step's top-1 on those tokens and on the rest. A drafter that copies gets
  the copyable ones more often than the others;
- a prompt lookup first (`speculative.prompt_lookup_first`): acceptance length at LOOKUP_K of the
  drafter alone and with the engine's own lookup (engine/vllm_fixes.py `lookup_drafts`, a match
  of LOOKUP_FIRST or more tokens) drafting first where it proposes, at every answer position.

Runs the target with transformers on CPU (greedy answers, then its hidden states), the drafters
in float32 with the same unrolled forward training uses (Drafter.unrolled).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from specserve.drafter.data import capture_features
from specserve.drafter.model import Drafter
from specserve.drafter.pipeline import eval_sets
from specserve.drafter.train import load_records, offline_acceptance, sequence_batch, target_weights

SINK_TOKENS = 4
SETS = ("chat", "long")
# The suffix lengths a prompt lookup tries, longest first: the default config's `ngram` arm's
# prompt_lookup_min and prompt_lookup_max.
LOOKUP_NGRAM = (2, 4)
LOOKUP_FIRST = 3  # the shortest match whose drafts replace the drafter's (docs/config.md)
LOOKUP_K = 3


def held_out_records(
    target_dir: str, per_set: int, max_new_tokens: int, work_dir: Path, aux_layer_ids
) -> dict[str, list[dict]]:
    """Captured target states of held-out prompts with the target's own greedy answers
    (answers and states cached in `work_dir`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    answers = {name: work_dir / f"{name}-{per_set}-{max_new_tokens}.jsonl" for name in SETS}
    missing = [name for name, path in answers.items() if not path.exists()]
    if missing:
        sets = eval_sets(per_set, missing)
        for name, rows in _target_answers(target_dir, sets, missing, max_new_tokens).items():
            answers[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    records = {}
    for name, path in answers.items():
        shards = capture_features(path, target_dir, work_dir / f"shards-{name}", aux_layer_ids)
        records[name] = load_records(shards)
    return records


def _target_answers(
    target_dir: str, sets: dict[str, list], names: list[str], max_new_tokens: int
) -> dict[str, list[dict]]:
    """The target's greedy answer to each conversation of the named sets (transformers)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    answered: dict[str, list[dict]] = {}
    for name in names:
        rows = answered.setdefault(name, [])
        for messages in tqdm(sets[name], desc=f"target answers ({name})"):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer(str(text), return_tensors="pt", add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
            answer = out[0, prompt["input_ids"].shape[1] :]
            reply = {
                "role": "assistant",
                "content": tokenizer.decode(answer, skip_special_tokens=True),
            }
            rows.append({"messages": [*messages, reply], "kind": name})
    return answered


class Probe:
    """Records attention shares and fed-forward hidden RMS per step during Drafter.unrolled,
    while installed on the model (a context manager: leaving it restores the model)."""

    def __init__(self, model: Drafter, steps: int) -> None:
        self.model, self.steps = model, steps
        self.attention = torch.zeros(steps, 3)  # context, sink, own drafts
        self.rms = torch.zeros(steps + 1)  # input of step 0, then fed to steps 1..steps
        self.queries = torch.zeros(steps)
        self._step = 0
        self._context = 0
        attn = model.midlayer.self_attn
        self._attend, self._next_hidden = attn.attend, model.next_hidden
        attn.attend = self.attend  # type: ignore[method-assign]
        model.next_hidden = self.next_hidden  # type: ignore[method-assign]

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        del self.model.midlayer.self_attn.attend, self.model.next_hidden

    def run(self, record: dict) -> None:
        aux, inputs, _, _, first = sequence_batch(record, self.steps, max_len=1 << 30)
        self._step = 0
        with torch.no_grad():
            start = self.model.combine(aux.float())[:, first:]
            self.rms[0] += _rms(start) * start.shape[1]
            self.model.unrolled(aux.float(), inputs, self.steps, logits_from=first)

    def attend(self, q, k, v, mask):
        j = self._step
        if j == 0:
            self._context = k.shape[2]
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # (B, nh, Tq, S)
        per_query = probs.mean(1)[0]  # over heads: (Tq, S)
        context = per_query[:, : self._context].sum(-1)
        sink = per_query[:, :SINK_TOKENS].sum(-1)
        own = per_query[:, self._context :].sum(-1)
        self.attention[j] += torch.stack([context.sum(), sink.sum(), own.sum()])
        self.queries[j] += per_query.shape[0]
        return self._attend(q, k, v, mask)

    def next_hidden(self, normed, prenorm):
        fed = self._next_hidden(normed, prenorm)
        self.rms[self._step + 1] += _rms(fed) * fed.shape[1]
        self._step += 1
        return fed

    def result(self) -> dict[str, list[float]]:
        shares = self.attention / self.queries[:, None]
        tokens = self.queries[0]
        return {
            "attention_context": shares[:, 0].tolist(),
            "attention_sink": shares[:, 1].tolist(),
            "attention_own_drafts": shares[:, 2].tolist(),
            "hidden_rms": (self.rms / tokens).tolist(),
        }


def lookup_next(
    context: list[int], shortest: int = LOOKUP_NGRAM[0], longest: int = LOOKUP_NGRAM[1]
):
    """The token a prompt lookup proposes after `context`: the one that followed the latest
    earlier occurrence of its longest suffix of `longest` down to `shortest` tokens; None when
    no suffix occurred before."""
    for n in range(longest, shortest - 1, -1):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == suffix:
                return context[i + n]
    return None


def copy_split(model: Drafter, records: list[dict]) -> dict[str, float]:
    """The first draft step's top-1 on answer tokens a prompt lookup gets right (`copyable`)
    and on the others, and the copyable share of answer tokens."""
    right, counted = torch.zeros(2), torch.zeros(2)  # [copyable, other]
    for record in records:
        aux, inputs, labels, _, first = sequence_batch(record, 1, max_len=1 << 30)
        with torch.no_grad():
            (logits,) = model.unrolled(aux.float(), inputs, 1, logits_from=first)
        label = labels[0][0, first:]
        ok = logits[0].argmax(-1) == model.to_draft(label.clamp(min=0))
        ids = record["input_ids"].tolist()
        for t in (label >= 0).nonzero().flatten().tolist():
            position = first + t + 2  # the label's index in ids (sequence_batch)
            kind = 0 if lookup_next(ids[:position]) == ids[position] else 1
            right[kind] += int(ok[t])
            counted[kind] += 1
    top1 = (right / counted.clamp(min=1)).tolist()
    return {
        "copyable_share": float(counted[0] / counted.sum().clamp(min=1)),
        "first_step_right_copyable": top1[0],
        "first_step_right_other": top1[1],
    }


@torch.no_grad()
def lookup_first_acceptance(
    model: Drafter, records: list[dict], k: int = LOOKUP_K, shortest: int = LOOKUP_FIRST
) -> dict[str, float]:
    """Acceptance length at k over every answer position (1 + the leading draft tokens that are
    the target's own), with the drafter's teacher-forced steps alone and with a prompt lookup's
    tokens in their place where the lookup proposes, as the engine combines them."""
    import numpy as np

    from specserve.engine.vllm_fixes import lookup_drafts

    accepted = {"drafter": 0, "lookup_first": 0}
    positions = 0
    for record in records:
        aux, inputs, labels, _, first = sequence_batch(record, k, max_len=1 << 30)
        logits = model.unrolled(aux.float(), inputs, k, logits_from=first)
        right = [
            (step[0].argmax(-1) == model.to_draft(label[0, first:].clamp(min=0))).tolist()
            for step, label in zip(logits, labels, strict=True)
        ]
        ids = record["input_ids"].numpy().astype(np.int32)
        answer = (labels[0][0, first:] >= 0).nonzero().flatten().tolist()
        for t in answer:
            position = first + t + 2  # the first draft token's index in ids (sequence_batch)
            truth = ids[position : position + k].tolist()
            looked_up = lookup_drafts(ids[:position], [-1] * k, shortest, 1 << 30)
            for name, mine in (("drafter", [-1] * k), ("lookup_first", looked_up)):
                ok = [
                    (mine[j] == truth[j]) if mine[j] != -1 else bool(right[j][t])
                    for j in range(min(k, len(truth)))
                ]
                accepted[name] += next((j for j, good in enumerate(ok) if not good), len(ok))
            positions += 1
    n = max(positions, 1)
    return {
        "acceptance_length": 1 + accepted["drafter"] / n,
        "acceptance_length_lookup_first": 1 + accepted["lookup_first"] / n,
    }


def _rms(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean(-1).sqrt().mean())


def diagnose(
    target_dir: str, drafters: dict[str, str], *, per_set: int, steps: int, work_dir: Path
) -> dict[str, Any]:
    embed = target_weights(target_dir)["embed"].float()
    models = {name: Drafter.from_pretrained(path, embed).eval() for name, path in drafters.items()}
    layers = next(iter(models.values())).config.aux_layer_ids
    records = held_out_records(target_dir, per_set, 128, work_dir, layers)
    out: dict[str, Any] = {"steps": steps, "sink_tokens": SINK_TOKENS, "results": []}
    for name, model in models.items():
        for set_name, set_records in records.items():
            acceptance = offline_acceptance(model, set_records, steps)
            with Probe(model, steps) as probe:
                for record in set_records:
                    probe.run(record)
            chain = acceptance.chain
            conditional = [chain[0]] + [
                chain[j] / chain[j - 1] if chain[j - 1] > 0 else 0.0 for j in range(1, steps)
            ]
            out["results"].append(
                {
                    "drafter": name,
                    "set": set_name,
                    "prompts": len(set_records),
                    "tokens": acceptance.tokens,
                    "acceptance_by_position": chain,
                    "acceptance_given_previous": conditional,
                    **probe.result(),
                    **copy_split(model, set_records),
                    **lookup_first_acceptance(model, set_records),
                }
            )
    return out


def markdown(report: dict[str, Any]) -> str:
    steps = report["steps"]
    head = " | ".join(f"step {j + 1}" for j in range(steps))
    lines = [f"| drafter | set | figure | {head} |", "| --- | --- | --- |" + " --- |" * steps]
    figures = (
        ("attention on context", "attention_context"),
        (f"attention on first {report['sink_tokens']} tokens", "attention_sink"),
        ("attention on own drafts", "attention_own_drafts"),
        ("RMS of hidden fed on", "hidden_rms"),
        ("acceptance at position", "acceptance_by_position"),
        ("acceptance given previous", "acceptance_given_previous"),
    )
    for row in report["results"]:
        for label, key in figures:
            values = row[key][1:] if key == "hidden_rms" else row[key]
            cells = " | ".join(f"{v:.3f}" if v < 10 else f"{v:.1f}" for v in values[:steps])
            lines.append(f"| {row['drafter']} | {row['set']} | {label} | {cells} |")
    lines += [
        "",
        "| drafter | set | answer tokens a prompt lookup gets right | first step right on them "
        f"| on the others | acceptance length at k = {LOOKUP_K} | with a lookup of "
        f"{LOOKUP_FIRST}+ tokens first |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['drafter']} | {row['set']} | {row['copyable_share']:.3f} "
            f"| {row['first_step_right_copyable']:.3f} | {row['first_step_right_other']:.3f} "
            f"| {row['acceptance_length']:.3f} | {row['acceptance_length_lookup_first']:.3f} |"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = (
        ("attention_context", "attention on context"),
        ("attention_sink", f"attention on first {report['sink_tokens']} tokens"),
        ("hidden_rms", "RMS of hidden state fed to next step"),
        ("acceptance_given_previous", "acceptance given previous accepted"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        for row in report["results"]:
            values = row[key][1:] if key == "hidden_rms" else row[key]
            style = "-" if row["set"] == "chat" else "--"
            ax.plot(
                range(1, len(values) + 1),
                values,
                style,
                marker="o",
                label=f"{row['drafter']} ({row['set']})",
            )
        ax.set_title(title)
        ax.set_xlabel("draft step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
