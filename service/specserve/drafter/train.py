"""Training-time test (TTT) training of a drafter on captured target hidden states.

Each sequence is unrolled for `steps` draft steps with the drafter's own hidden states fed back,
exactly as it drafts in vLLM (`Drafter.unrolled`); the loss is cross-entropy against the target's
own greedy tokens on the answer part (optionally blended with its whole next-token distribution),
weighted per step. AdamW with linear warm-up and cosine decay, gradient clipping, bf16 autocast
on CPUs with bf16 instructions, fixed seeds, and a checkpoint every `checkpoint_every` optimizer
steps that `train` resumes from. Given validation sequences (never trained on), it measures their
offline acceptance every `validate_every` updates and ends on the best weights seen (early
stopping), so a longer run can never end worse than its best point, nor worse than where it
started (the weights before the first update are validated too).

Data parallel: run `train` in every process of a `torch.distributed` group (`torchrun`; gloo on
CPU, NCCL on GPUs; `specserve.drafter.distributed` is the launcher). Every rank walks the same
seeded sequence order; each update's sequences are dealt out round-robin and the summed
gradients all-reduced, so an update is the same sum as in one process (up to float summation
order) and every rank holds the same weights. Rank 0 validates, checkpoints and shows progress.
The model's device (CPU or CUDA) is where batches go.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.drafter.memory import GrowthLimit
from specserve.drafter.model import Drafter, DrafterConfig
from specserve.hardware import fast_dtype

# Padded tokens per forward by device. A GPU idles on one sequence at a time; a 2-core CPU is
# compute-bound at any batch, and larger ones fall out of its caches (BENCHMARKS.md, "Drafter
# trainer speed").
BATCH_TOKENS = {"cuda": 32768, "cpu": 2048}


def batch_tokens_for(config_value: int | None, device: torch.device) -> int:
    return config_value if config_value is not None else BATCH_TOKENS.get(device.type, 2048)


@dataclass
class TrainConfig:
    steps: int = 3  # unrolled draft steps (TTT depth); >= the k it will serve with is best
    step_weight_decay: float = 0.8  # loss weight of step j is decay ** j
    epochs: float = 1.0
    updates: int = 0  # optimizer steps to take; 0: as many as `epochs` makes
    lr: float = 1e-3
    warmup_fraction: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    tokens_per_update: int = 512  # answer tokens per optimizer step; smaller steps learn faster
    # Padded tokens per forward pass: an update's sequences, sorted by length, run together in
    # forwards of at most this many (B x longest) tokens; 0 runs one sequence per forward;
    # None: the device's `BATCH_TOKENS`.
    batch_tokens: int | None = None
    max_len: int = 2048  # longer sequences keep their last max_len tokens (the answer)
    seed: int = 0
    checkpoint_every: int = 50
    validate_every: int = 250
    soft_labels: float = 0.0  # loss share of the target's distribution (rest: its greedy token)


@dataclass
class OfflineAcceptance:
    """Greedy drafting simulated on captured sequences: at every answer position, are steps
    1..j all the target's own next tokens? vLLM drafts only where the last draft stopped, so
    its measured acceptance runs ~0.05-0.1 lower (BENCHMARKS.md), but the two move together."""

    tokens: int
    step_top1: list[float]  # step j right (earlier steps fed the right tokens)
    chain: list[float]  # steps 1..j all right: the chance the j-th draft token is accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + sum(self.chain)


def autocast(device: torch.device | None = None) -> torch.autocast:
    """bf16 autocast on CUDA, and where the CPU has bf16 instructions; elsewhere it is ~10x
    slower than float32 (a drafter forward + backward: 21 s vs 2 s on an AVX2 machine)."""
    kind = device.type if device is not None else "cpu"
    enabled = kind == "cuda" or fast_dtype() == "bfloat16"
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=enabled)


def _group() -> tuple[int, int]:
    """(rank, world size) of the torch.distributed group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_records(shards: list[Path]) -> list[dict]:
    """The shards' records, their tensors memory-mapped: the pages are the files' own, shared by
    every process that trains on them (Ray Train's workers) and given back under pressure."""
    records = []
    for shard in shards:
        records += torch.load(shard, weights_only=True, mmap=True)
    return records


def split_validation(records: list[dict], share: int = 25) -> tuple[list[dict], list[dict]]:
    """Hold one sequence in `share` out of training, chosen by content (stable across runs)."""
    training: list[dict] = []
    validation: list[dict] = []
    for record in records:
        digest = hashlib.sha1(record["input_ids"].numpy().tobytes()).digest()
        (validation if digest[0] % share == 0 else training).append(record)
    return training, validation


def draft_vocabulary(records: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target tokens most frequent in the answers (what the drafter must predict)."""
    counts: Counter[int] = Counter()
    for r in records:
        counts.update(r["input_ids"][r["answer_start"] :].tolist())
    ids = [token for token, _ in counts.most_common(size)]
    if len(ids) < size:  # pad with the lowest unused ids
        used = set(ids)
        ids += [t for t in range(vocab_size) if t not in used][: size - len(ids)]
    return torch.tensor(ids)


def sequence_batch(record: dict, steps: int, max_len: int):
    """-> aux (1, T, 3H), input_ids (1, T+steps-1), labels list of (1, T) per step, the target's
    final states list of (1, T, H) per step (at index t of step j: the state at position
    t + 1 + j, whose next-token distribution step j's label came from; None when the record has
    none), and the first index whose label at some step is an answer token (logits before it
    are not needed)."""
    ids = record["input_ids"].long()
    aux = record["aux"]
    start = max(0, ids.numel() - 1 - max_len)
    ids, aux, answer_start = ids[start:], aux[start:], record["answer_start"] - start
    T = ids.numel() - 1  # positions 0..T-1 have a next token
    padded = torch.cat([ids, torch.full((steps + 1,), -100, dtype=torch.long)])
    inputs = padded[1 : T + steps].clamp(min=0)
    labels = []
    for j in range(steps):
        label = padded[2 + j : 2 + j + T].clone()
        position = torch.arange(T) + 2 + j
        label[position < max(answer_start, 1)] = -100
        labels.append(label[None])
    finals = None
    if "final" in record:
        final = record["final"][start:]
        final = torch.cat([final, final.new_zeros(steps, final.shape[-1])])
        finals = [final[1 + j : 1 + j + T][None] for j in range(steps)]
    first = max(0, min(max(answer_start, 1) - 2 - (steps - 1), T - 1))
    return aux[:T][None], inputs[None], labels, finals, first


@dataclass
class Batch:
    """Several sequences padded on the right to one length T, so one forward runs them all.
    Padding sits after each sequence's end, where causal attention never reaches back from a
    real position, and its labels are -100."""

    aux: torch.Tensor  # (B, T, 3H)
    inputs: torch.Tensor  # (B, T + steps - 1)
    labels: list[torch.Tensor]  # per step (B, T - first)
    finals: list[torch.Tensor] | None  # per step (B, T - first, H)
    first: int  # the first index whose logits are needed, for every sequence
    answer_tokens: int  # labels of step 1 that are answer tokens (what an update counts)

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.aux.to(device, non_blocking=True),
            self.inputs.to(device, non_blocking=True),
            [x.to(device, non_blocking=True) for x in self.labels],
            [x.to(device, non_blocking=True) for x in self.finals] if self.finals else None,
            self.first,
            self.answer_tokens,
        )


def collate(records: list[dict], steps: int, max_len: int, with_finals: bool = False) -> Batch:
    """What `sequence_batch` makes of each record, padded to the longest and stacked, built on
    the records' device in a few whole-batch operations (records resident on a GPU are
    collated there: no host copy, no per-record kernels beyond one copy of each tensor). The
    target's final states only `with_finals` (soft labels), as they double the bytes built."""
    device = records[0]["aux"].device
    starts = [max(0, r["input_ids"].numel() - 1 - max_len) for r in records]
    lengths = [r["input_ids"].numel() - 1 - s for r, s in zip(records, starts, strict=True)]
    answers = [max(r["answer_start"] - s, 1) for r, s in zip(records, starts, strict=True)]
    B, T = len(records), max(lengths)
    first = min(
        max(0, min(a - 2 - (steps - 1), n - 1)) for a, n in zip(answers, lengths, strict=True)
    )
    # Token ids at positions 0..T (-100 past each sequence's end), steps more of padding.
    ids = torch.full((B, T + 1 + steps), -100, dtype=torch.long, device=device)
    aux = torch.zeros(
        B, T, records[0]["aux"].shape[-1], dtype=records[0]["aux"].dtype, device=device
    )
    has_finals = with_finals and all("final" in r for r in records)
    if has_finals:
        final = records[0]["final"]
        padded_finals = torch.zeros(B, T + steps, final.shape[-1], dtype=final.dtype, device=device)
    for b, (r, s, n) in enumerate(zip(records, starts, lengths, strict=True)):
        ids[b, : n + 1] = r["input_ids"][s:]
        aux[b, :n] = r["aux"][s : s + n]
        if has_finals:
            padded_finals[b, : n + 1] = r["final"][s:]
    inputs = ids[:, 1 : T + steps].clamp(min=0)
    # Step j's label at index t is the token at position t + 2 + j, kept from the answer on.
    position = torch.arange(first, T, device=device)
    answer = torch.tensor(answers, device=device)[:, None]
    labels = []
    for j in range(steps):
        label = ids[:, 2 + j + first : 2 + j + T].clone()
        label[position[None] + 2 + j < answer] = -100
        labels.append(label)
    finals = None
    if has_finals:  # step j's label came from the target's state at position t + 1 + j
        finals = [padded_finals[:, 1 + j + first : 1 + j + T] for j in range(steps)]
    counted = sum(answer_labels(r, max_len) for r in records)
    return Batch(aux, inputs, labels, finals, first, counted)


def resident(records: list[dict], device: torch.device, *, finals: bool) -> list[dict]:
    """The records with their tensors on `device` (the final states only if `finals`), copied
    once, so that collating a batch needs no host work and no transfer. Where they would take
    more than half of the device's free memory, or on a CPU, the records as they are."""
    if device.type != "cuda" or not records:
        return records
    if device.index is None:  # "cuda": the current card, as tensors name it ("cuda:0")
        device = torch.device("cuda", torch.cuda.current_device())
    if records[0]["aux"].device == device:
        return records  # there already: the build copies once for the probe, run and validations
    keys = ("input_ids", "aux", "final") if finals else ("input_ids", "aux")
    needed = sum(r[k].nbytes for r in records for k in keys if k in r)
    free, _ = torch.cuda.mem_get_info(device)
    if needed > free / 2:
        return records
    return [
        {
            k: (v.to(device, non_blocking=True) if k in keys else v)
            for k, v in r.items()
            if k in keys or not isinstance(v, torch.Tensor)
        }
        for r in records
    ]


def plan_forwards(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sequences (their indices into `lengths`) into forwards of at most `batch_tokens`
    padded tokens (count x longest), longest first, so that neighbours in length pad each
    other little. A sequence longer than the budget runs alone; 0 runs each alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def sequence_length(record: dict, max_len: int) -> int:
    """Positions `sequence_batch` keeps of a record (those with a next token, at most max_len)."""
    return min(record["input_ids"].numel() - 1, max_len)


@torch.no_grad()
def offline_acceptance(
    model: Drafter, records: list[dict], steps: int, batch_tokens: int | None = None
) -> OfflineAcceptance:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batch_tokens = batch_tokens_for(batch_tokens, device)
    records = resident(records, device, finals=False)
    right = torch.zeros(steps, device=device)
    chained = torch.zeros(steps, device=device)
    tokens = 0
    lengths = [sequence_length(r, 1 << 30) for r in records]
    for group in plan_forwards(lengths, batch_tokens):
        batch = collate([records[i] for i in group], steps, max_len=1 << 30).to(device)
        with (
            torch.inference_mode(),
            autocast(device),
        ):  # no autograd graph: a fraction of the memory
            logits = model.unrolled(batch.aux.float(), batch.inputs, steps, batch.first)
        answer = batch.labels[0] >= 0
        chain = torch.ones_like(answer)
        for j, (step_logits, label) in enumerate(zip(logits, batch.labels, strict=True)):
            ok = (step_logits.argmax(-1) == model.to_draft(label.clamp(min=0))) & (label >= 0)
            chain &= ok
            right[j] += ok[answer].sum()
            chained[j] += chain[answer].sum()
        tokens += batch.answer_tokens
    model.train(was_training)
    n = max(tokens, 1)
    return OfflineAcceptance(tokens, (right / n).tolist(), (chained / n).tolist())


def batch_loss(
    model: Drafter,
    batch: Batch,
    weights: list[float],
    soft_weight: float = 0.0,
    teacher_head: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> the batch's weighted loss summed over its answer tokens, and per step the right
    top-1 guesses and the tokens they were counted over (tensors on the model's device: read
    them once an update, not once a batch). The draft `lm_head` runs on answer rows only."""
    device = batch.aux.device
    steps = len(weights)
    loss = torch.zeros((), device=device)
    correct = torch.zeros(steps, device=device, dtype=torch.long)
    counted = torch.zeros(steps, device=device, dtype=torch.long)
    with autocast(device):
        hidden = model.unrolled(
            batch.aux.float(), batch.inputs, steps, logits_from=batch.first, heads=False
        )
        for j, (normed, label) in enumerate(zip(hidden, batch.labels, strict=True)):
            answer = label >= 0
            target = model.to_draft(label[answer])  # (N,) -100 where the draft has no such id
            logits = model.lm_head(normed[answer])  # (N, V_draft)
            with torch.autocast(device.type, enabled=False):
                log_p = F.log_softmax(logits.float(), dim=-1)
            step_loss = F.nll_loss(log_p, target, ignore_index=-100, reduction="sum")
            if soft_weight:
                if batch.finals is None or teacher_head is None:
                    raise ValueError("soft_labels needs records with final states")
                with torch.no_grad():
                    teacher = batch.finals[j][answer].float() @ teacher_head.T
                soft = -(teacher.softmax(-1) * log_p).sum()
                step_loss = (1 - soft_weight) * step_loss + soft_weight * soft
            loss = loss + weights[j] * step_loss
            valid = target >= 0
            correct[j] = ((logits.argmax(-1) == target) & valid).sum()
            counted[j] = valid.sum()
    return loss, correct, counted


def train(
    model: Drafter,
    records: list[dict],
    out_dir: Path,
    config: TrainConfig,
    *,
    validation: list[dict] | None = None,
    target_head: torch.Tensor | None = None,
    desc: str = "train",
    deadline: float | None = None,
) -> Drafter:
    """Train `model` on `records`. With `config.soft_labels` > 0 and the target's output head
    for the draft vocabulary (`target_head`, (V_draft, H)), that share of the loss is the
    cross-entropy against the target's whole next-token distribution, recomputed from the
    captured final states, instead of against its greedy token alone. At `deadline` (a
    `time.monotonic()` value) it stops early: validated, checkpointed, on the best weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    soft_weight = config.soft_labels
    if soft_weight and target_head is None:
        raise ValueError("soft_labels needs the target's output head (target_head)")
    device = next(model.parameters()).device
    rank, world = _group()
    if deadline is not None and world > 1:
        raise ValueError("a deadline needs one process: ranks could stop at different updates")
    teacher_head = target_head.float().to(device) if target_head is not None else None
    records = resident(records, device, finals=soft_weight > 0)
    if validation:
        validation = resident(validation, device, finals=False)
    torch.manual_seed(config.seed)
    order_rng = random.Random(config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    answer_tokens = sum(r["input_ids"].numel() - r["answer_start"] for r in records)
    total_updates = config.updates or max(
        1, int(config.epochs * answer_tokens / config.tokens_per_update)
    )
    warmup = max(1, int(config.warmup_fraction * total_updates))

    def lr_at(update: int) -> float:
        if update < warmup:
            return config.lr * (update + 1) / warmup
        progress = (update - warmup) / max(1, total_updates - warmup)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    update, position, order = 0, 0, []
    best: dict = {"length": 0.0, "update": 0, "model": None}
    history: list[dict] = []  # validation results, also written to validation.json
    checkpoint = out_dir / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        update, position, order = state["update"], state["position"], state["order"]
        order_rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        best, history = state.get("best", best), state.get("history", history)

    bar = tqdm(total=total_updates, initial=update, desc=desc, unit="update", disable=rank != 0)

    def validate() -> None:
        nonlocal best
        assert validation is not None
        result = offline_acceptance(model, validation, config.steps, config.batch_tokens)
        history.append({"update": update, **asdict(result)})
        (out_dir / "validation.json").write_text(json.dumps(history, indent=1))
        length = result.mean_acceptance_length
        if length > best["length"]:
            best = {"length": length, "update": update, "model": _copy(model.state_dict())}
        top1 = "/".join(f"{a:.2f}" for a in result.step_top1)
        bar.write(
            f"{desc} update {update}: validation acceptance length {length:.3f}, "
            f"top-1 {top1} (best {best['length']:.3f} at update {best['update']})"
        )

    if validation and rank == 0 and update == 0:
        validate()  # where training starts: the curve's origin, and the length to beat
    model.train()
    weights = [config.step_weight_decay**j for j in range(config.steps)]
    running = [0.0] * config.steps  # top-1 per step, averaged over recent updates
    start = update  # a resumed run averages from where it resumed
    growth = GrowthLimit() if device.type == "cpu" else None  # a GPU's blocks are not glibc's
    while update < total_updates:
        # The update's sequences, in the seeded order: whole ones until they hold
        # tokens_per_update answer tokens. Rank r computes every world-th of them.
        tokens, chosen = 0, []
        while tokens < config.tokens_per_update:
            if position >= len(order):
                order, position = list(range(len(records))), 0
                order_rng.shuffle(order)
            record = records[order[position]]
            position += 1
            tokens += max(answer_labels(record, config.max_len), 1)
            chosen.append(record)
        mine = chosen[rank::world]
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros(config.steps, device=device, dtype=torch.long)
        counted = torch.zeros(config.steps, device=device, dtype=torch.long)
        lengths = [sequence_length(r, config.max_len) for r in mine]
        for group in plan_forwards(lengths, batch_tokens_for(config.batch_tokens, device)):
            group_records = [mine[i] for i in group]
            batch = collate(
                group_records, config.steps, config.max_len, with_finals=soft_weight > 0
            )
            batch = batch.to(device)
            loss, right, seen = batch_loss(model, batch, weights, soft_weight, teacher_head)
            (loss / config.tokens_per_update).backward()
            loss_sum += loss.detach()
            correct += right
            counted += seen
        stats = torch.cat([loss_sum[None].double(), correct.double(), counted.double()])
        if world > 1:
            stats = _all_reduce(params, stats)
        stats_list = stats.tolist()  # the update's one read back to the host
        loss_total = stats_list[0]
        right_steps = stats_list[1 : 1 + config.steps]
        seen_steps = stats_list[1 + config.steps :]
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_at(update)
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        if growth is not None:
            # Each update frees blocks whose sizes change with its sequences, and glibc kept
            # them: under bf16 autocast training grew by 2.6 GB over 100 updates without this
            # (docs/drafters.md, "Memory").
            growth.check()
        update += 1
        smoothing = min(0.98, 1 - 1 / (update - start))  # a plain mean for the first updates
        running = [
            smoothing * r + (1 - smoothing) * c / max(n, 1)
            for r, c, n in zip(running, right_steps, seen_steps, strict=True)
        ]
        bar.update()
        bar.set_postfix(
            loss=f"{loss_total / tokens:.3f}", acc="/".join(f"{a:.2f}" for a in running)
        )
        if rank != 0:
            continue
        last = update == total_updates or (deadline is not None and time.monotonic() > deadline)
        if validation and (update % config.validate_every == 0 or last):
            validate()
        if update % config.checkpoint_every == 0 or last:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "update": update,
                    "position": position,
                    "order": order,
                    "rng": order_rng.getstate(),
                    "torch_rng": torch.get_rng_state(),
                    "config": asdict(config),
                    "best": best,
                    "history": history,
                },
                checkpoint.with_suffix(".tmp"),
            )
            checkpoint.with_suffix(".tmp").rename(checkpoint)
        if last and update < total_updates:
            bar.write(f"{desc}: the deadline came at update {update} of {total_updates}")
            break
    bar.close()
    if best["model"] is not None:
        model.load_state_dict(best["model"])
    model.eval()
    return model


def answer_labels(record: dict, max_len: int) -> int:
    """Answer tokens step 1 learns from in a record (what an update's size counts), without
    building its tensors: `sequence_batch`'s step-1 label at index t is the token at position
    t + 2, an answer token from the answer's start on, up to the last position."""
    ids = record["input_ids"].numel()
    start = max(0, ids - 1 - max_len)
    last = ids - 1 - start  # T: the last position with a token
    return max(0, last + 1 - max(record["answer_start"] - start, 2))


def _all_reduce(params: list[torch.nn.Parameter], stats: torch.Tensor) -> torch.Tensor:
    """Sum gradients (a rank that drew no sequence this update adds zeros) and the update's
    statistics over the group."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    dist.all_reduce(stats)
    return stats


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in state.items()}


def captured_rms(records: list[dict], layers: int, sample: int = 200) -> list[float]:
    """Mean per-token RMS of each captured layer's hidden states (first `sample` sequences)."""
    totals, count = torch.zeros(layers), 0
    for record in records[:sample]:
        chunks = record["aux"].float().chunk(layers, dim=-1)
        totals += torch.stack([x.pow(2).mean(-1).sqrt().sum() for x in chunks])
        count += record["aux"].shape[0]
    return (totals / max(count, 1)).tolist()


def target_weights(target_dir: str) -> dict[str, torch.Tensor]:
    """The target's input embedding and output head (the embedding when they are tied)."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(target_dir) / "model.safetensors"))
    embed = next((v for k, v in weights.items() if k.endswith("embed_tokens.weight")), None)
    head = next((v for k, v in weights.items() if k.endswith("lm_head.weight")), embed)
    if embed is None or head is None:
        raise ValueError(f"{target_dir}: no embed_tokens.weight in model.safetensors")
    return {"embed": embed, "head": head}


def init_from_target_layer(model: Drafter, target_dir: str) -> None:
    """A head start for the first draft step: the drafter's decoder layer starts as the target's
    last decoder layer, reading the hidden-state half of its input (the embedding half keeps its
    random start), and `fc` starts as a pass-through of the last captured state (the input of
    target layer L-3, the nearest captured one to what the last layer reads)."""
    from safetensors.torch import load_file

    weights = {
        k: v.float() for k, v in load_file(str(Path(target_dir) / "model.safetensors")).items()
    }
    last = max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    layer = {
        k.removeprefix(f"model.layers.{last}."): v
        for k, v in weights.items()
        if k.startswith(f"model.layers.{last}.")
    }
    m, hidden = model.midlayer, model.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            # (out, 2H): the input is [input_layernorm(embedding), hidden_norm(hidden)]
            getattr(m.self_attn, name).weight[:, hidden:] = layer[f"self_attn.{name}.weight"]
        m.self_attn.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(layer[f"mlp.{name}.weight"])
        m.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        m.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
        model.fc.weight.zero_()  # (H, n_aux * H)
        model.fc.weight[:, -hidden:] = torch.eye(hidden)


def new_drafter(
    target_dir: str,
    records: list[dict],
    *,
    draft_vocab_size: int,
    **switches: bool,
) -> Drafter:
    """A drafter shaped for the target, with its embedding and a draft vocabulary from data.

    `lm_head` starts random: starting it as the target's own output rows (and `norm` as its
    final norm) matched step 1 but cost later steps (BENCHMARKS.md).
    `fc_norm` weights start at each captured layer's mean RMS: `fc` then first sees inputs on
    the scale EAGLE-3's `fc` sees, without per-token scale swings, instead of three layers
    squashed to unit RMS (their scales here differ ~8x). It learns faster and ends higher
    (BENCHMARKS.md)."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_dir)
    config = DrafterConfig.for_target(target_config, draft_vocab_size=draft_vocab_size, **switches)
    model = Drafter(config)
    target = target_weights(target_dir)
    model.embed_tokens.weight.data.copy_(target["embed"].float())
    model.set_draft_vocab(draft_vocabulary(records, draft_vocab_size, config.vocab_size))
    if model.fc_norm is not None:
        scales = captured_rms(records, len(model.fc_norm))
        for norm, scale in zip(model.fc_norm, scales, strict=True):
            torch.nn.init.constant_(norm.get_parameter("weight"), scale)
    return model
