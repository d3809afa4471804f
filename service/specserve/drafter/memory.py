"""How many adapt workers fit beside what already runs on a node, and at what sizes.

Ray's memory monitor kills a worker once its node uses more than `RAY_memory_usage_threshold` of
its memory (0.95 by default): beside serving engines, two Train workers too many ended an adapt
that way. So adapt sizes itself before it starts any: each worker's peak is estimated from the
target's shape (`worker_bytes`), each node's room is what it has below the threshold now
(`NodeMemory`, read where the workers would run), and `plan` takes the most workers that fit,
then smaller feature batches, then shorter sequences, or refuses with one line that says what
would fit.

A worker's peak (measured: docs/drafters.md, "Memory"), on a CPU:
- the process: Python, torch, transformers, Ray (`PROCESS_BYTES`);
- the target's weights in the features' dtype;
- one feature forward: every layer's hidden states (transformers keeps them all with
  `output_hidden_states`), the MLP's intermediate activations and the attention scores of the
  longest sequence in it, for `batch_tokens` padded tokens;
- training, which follows the features in the same process once the target's weights are gone
  (data.py hands their pages back): the target's embedding and the drafter's weights, gradients
  and AdamW moments in float32, and one update, the drafter unrolled `steps` deep over the
  update's tokens, its logits over the draft vocabulary and their gradients dominating.
Feature records on disk are memory-mapped while training (train.load_records): page cache that
the kernel takes back under pressure, which Ray's monitor does not count as used.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# Ray's default kill threshold and the variable that changes it (Ray's memory monitor).
RAY_THRESHOLD_ENV = "RAY_memory_usage_threshold"
RAY_DEFAULT_THRESHOLD = 0.95
# A Ray Train worker process with torch, transformers, specserve and gloo (1.2 GB measured, in
# all, for a rank with little of the work; 0.4 GB for torch and transformers without Ray).
PROCESS_BYTES = 1200 * 2**20
# Measured peaks over the sum of the tensors a forward holds (allocator slack, copies): 2.2-2.3x.
SLACK = 2.3
# Float32 values per hidden unit that one training forward keeps per padded token for its backward
# (the drafter's step-0 pass over the context, the unrolled steps' layers and attention).
TRAIN_ACTIVATIONS = 64
# Under bf16 autocast (a CPU with bf16 instructions) training keeps about twice those: it added
# 1.18 GB where float32's terms estimated 0.81 GB (docs/drafters.md, "Memory").
BF16_AUTOCAST_ACTIVATIONS = 2
# Training hands the freed pages back only once the process holds this much more than after its
# first update: each update frees about its activations, and handing those back every time made
# the next update fault them in again, 16 % of a CPU update's time (docs/drafters.md, "Memory").
TRAIN_GROWTH_ALLOWANCE = 256 * 2**20
# What the estimate may miss (allocator slack, threads' buffers): kept free besides.
MARGIN = 0.15
# The smallest sizes a plan goes down to before it refuses.
MIN_BATCH_TOKENS = 1024
MIN_MAX_LEN = 1024


class MemoryPlanError(RuntimeError):
    """No worker fits: the message is the one line the loop and the CLI show."""


@dataclass(frozen=True)
class NodeMemory:
    """One node's memory as Ray's monitor sees it: the cgroup's limit where there is one (a
    Kubernetes pod), else the machine's."""

    node: str
    total: int
    used: int
    threshold: float

    @property
    def room(self) -> int:
        """Bytes that may still be used before Ray starts killing workers."""
        return max(0, int(self.total * self.threshold) - self.used)


def node_memory(node: str) -> NodeMemory:
    """The memory of the node this runs on, labelled `node` (adapt runs it there as a Ray task:
    `adapt.memory_plan`), read as Ray's monitor reads it: the container's cgroup (v1 or v2) where
    there is one, its file pages (the kernel's to take back) not counted as used; else the
    machine's."""
    import psutil
    from ray._private.utils import get_cgroup_mem_stats

    threshold = float(os.environ.get(RAY_THRESHOLD_ENV, RAY_DEFAULT_THRESHOLD))
    machine = psutil.virtual_memory()
    total, used = machine.total, machine.total - machine.available
    cgroup = get_cgroup_mem_stats()  # (used, limit), the limit capped at the machine's memory
    if cgroup is not None and cgroup[1] < total:
        used, total = cgroup
    return NodeMemory(node, total, used, threshold)


@dataclass(frozen=True)
class TargetShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    weight_bytes: int  # in the dtype the features run in
    file_bytes: int  # the checkpoint, mapped while it is converted to that dtype
    dtype_bytes: int = 4  # that dtype's: 2 where features and training run in bf16 (autocast)

    @classmethod
    def of(cls, target_dir: str, dtype_bytes: int | None = None) -> TargetShape:
        """The target's shape from its checkpoint, for features in `dtype_bytes` (default: this
        machine's, bf16 where its CPU has bf16 instructions or on a GPU, else float32)."""
        if dtype_bytes is None:
            from specserve.hardware import fast_dtype

            dtype_bytes = 2 if fast_dtype() == "bfloat16" else 4
        config = json.loads((Path(target_dir) / "config.json").read_text())
        stored = {"float32": 4, "bfloat16": 2, "float16": 2}
        stored_bytes = stored.get(config.get("dtype") or config.get("torch_dtype"), 2)
        files = sum(p.stat().st_size for p in Path(target_dir).glob("*.safetensors"))
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=config["num_attention_heads"],
            vocab=config["vocab_size"],
            weight_bytes=files * dtype_bytes // stored_bytes,
            file_bytes=files,
            dtype_bytes=dtype_bytes,
        )


@dataclass(frozen=True)
class Sequences:
    """The lengths (prompt + answer tokens) adapt computes states for."""

    longest: int
    mean: float
    per_shard: int  # sequences in one shard, whose states a worker holds until it is written

    @classmethod
    def of(cls, lengths: list[int], per_shard: int) -> Sequences:
        if not lengths:
            return cls(0, 0.0, 0)
        return cls(max(lengths), sum(lengths) / len(lengths), min(per_shard, len(lengths)))


@dataclass(frozen=True)
class Sizes:
    batch_tokens: int  # padded tokens per feature forward
    max_len: int  # the longest sequence kept (longer ones keep their last max_len tokens)
    tokens_per_update: int
    steps: int
    draft_vocab: int
    drafter_params: int = 0  # the drafter's own weights (not the target's embedding it shares)
    train_batch_tokens: int = 2048  # padded tokens per training forward (train.BATCH_TOKENS)


def checkpoint_params(directory: str | Path) -> int:
    """The number of weights in a checkpoint's model.safetensors, read from its header."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


def forward_bytes(target: TargetShape, data: Sequences, sizes: Sizes) -> int:
    """What one feature forward adds to a worker that holds the target: its tensors with the
    measured slack, and a shard's records held until written."""
    longest = max(1, min(sizes.max_len, data.longest, sizes.batch_tokens))
    # Every layer's hidden states and the MLP's activations, counted in float32 whatever the
    # weights' dtype: bfloat16 forwards on a CPU keep float32 intermediates too.
    width = (target.layers + 1) * target.hidden + 3 * target.intermediate
    states = sizes.batch_tokens * 4 * width
    # Attention scores and their softmax in float32, for as many of the longest sequences as
    # one forward takes.
    scores = (sizes.batch_tokens // longest) * target.heads * longest * longest * 4
    # A shard's records (aux states of three layers and the final one, bfloat16) until written.
    shard = data.per_shard * min(data.mean, sizes.max_len) * 4 * target.hidden * 2
    return int(SLACK * (states + scores) + shard)


def training_bytes(target: TargetShape, data: Sequences, sizes: Sizes) -> int:
    """What training holds: the target's embedding and the drafter's weights, gradients and two
    AdamW moments, all in float32; one update's logits, probabilities and their gradients over
    the draft vocabulary per unrolled step; and one forward's activations kept for its backward,
    over its padded tokens (a sequence longer than a forward's budget goes alone); and the
    growth the allocator may keep before training hands it back (`GrowthLimit`).
    `TRAIN_ACTIVATIONS` covers measured runs of the embedded target's drafter: 0.53-0.64 GB
    added at 2,048 tokens a forward, 0.69 GB at 2,690 (docs/drafters.md, "Memory")."""
    state = 4 * target.vocab * target.hidden + 4 * 4 * sizes.drafter_params
    update = sizes.tokens_per_update * sizes.steps * (4 * sizes.draft_vocab * 4)
    positions = max(sizes.train_batch_tokens, min(data.longest, sizes.max_len))
    activations = positions * TRAIN_ACTIVATIONS * target.hidden * 4
    if target.dtype_bytes == 2:  # bf16 autocast keeps its casts beside the float32 activations
        activations *= BF16_AUTOCAST_ACTIVATIONS
    return state + update + activations + TRAIN_GROWTH_ALLOWANCE


def worker_bytes(target: TargetShape, data: Sequences, sizes: Sizes) -> int:
    """The estimated peak of one worker: the process, and the larger of its two stages: the
    target's weights with the largest of the checkpoint's mapping while it loads and one feature
    forward, then training."""
    features = target.weight_bytes + max(target.file_bytes, forward_bytes(target, data, sizes))
    return int(PROCESS_BYTES + max(features, training_bytes(target, data, sizes)))


@dataclass(frozen=True)
class Plan:
    workers: int
    sizes: Sizes
    per_worker: int
    nodes: tuple[NodeMemory, ...]
    note: str  # what was cut to fit, "" when nothing was

    def describe(self) -> str:
        room = sum(n.room for n in self.nodes) / 2**30
        cut = f"; {self.note}" if self.note else ""
        return (
            f"{self.workers} workers of ~{self.per_worker / 2**30:.1f} GB each in the "
            f"{room:.1f} GB below Ray's kill threshold{cut}"
        )

    def as_dict(self) -> dict:
        return {
            "workers": self.workers,
            "per_worker_bytes": self.per_worker,
            "sizes": asdict(self.sizes),
            "nodes": [asdict(n) for n in self.nodes],
            "note": self.note,
        }


def fitting(nodes: list[NodeMemory], per_worker: int) -> int:
    """Workers that fit: on each node as many as its room holds with the margin kept free."""
    need = per_worker * (1 + MARGIN)
    return sum(int(n.room // need) for n in nodes)


def plan(
    requested: int,
    nodes: list[NodeMemory],
    target: TargetShape,
    data: Sequences,
    sizes: Sizes,
) -> Plan:
    """The most workers (up to `requested`) at the largest sizes that fit; MemoryPlanError
    when not one worker fits at the smallest."""
    candidates = [sizes]
    while candidates[-1].batch_tokens > MIN_BATCH_TOKENS:
        batch = max(MIN_BATCH_TOKENS, candidates[-1].batch_tokens // 2)
        candidates.append(replace(candidates[-1], batch_tokens=batch))
    while candidates[-1].max_len > MIN_MAX_LEN:
        max_len = max(MIN_MAX_LEN, candidates[-1].max_len // 2)
        candidates.append(replace(candidates[-1], max_len=max_len))
    for candidate in candidates:
        per_worker = worker_bytes(target, data, candidate)
        workers = min(requested, fitting(nodes, per_worker))
        if workers > 0:
            cuts = []
            if workers < requested:
                cuts.append(f"{requested} asked")
            if candidate.batch_tokens < sizes.batch_tokens:
                cuts.append(
                    f"feature batches of {candidate.batch_tokens} tokens, not {sizes.batch_tokens}"
                )
            if candidate.max_len < sizes.max_len:
                cuts.append(
                    f"sequences cut to their last {candidate.max_len} tokens, not {sizes.max_len}"
                )
            return Plan(workers, candidate, per_worker, tuple(nodes), ", ".join(cuts))
    smallest = worker_bytes(target, data, candidates[-1])
    room = max((n.room for n in nodes), default=0)
    threshold = nodes[0].threshold if nodes else RAY_DEFAULT_THRESHOLD
    raise MemoryPlanError(
        f"adapt does not fit: one worker needs ~{smallest * (1 + MARGIN) / 2**30:.1f} GB at the "
        f"smallest sizes, and no node has more than {room / 2**30:.1f} GB below Ray's kill "
        f"threshold ({threshold:.0%} of its memory); free memory (fewer engine replicas while "
        "it runs) or run adapt where there is room (`--address`)"
    )


class AnonymousPeak:
    """This process's peak anonymous memory while the block runs, sampled every `period_s` in a
    thread: what Ray's monitor counts as used (file pages, such as memory-mapped shards, are the
    kernel's to take back). A Ray worker process may have run other work before; its lifetime
    peak (`ru_maxrss`) would count that too."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> AnonymousPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_bytes())

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_bytes())
            self._stop.wait(self.period_s)


def anonymous_bytes() -> int:
    """This process's resident anonymous memory now (`RssAnon`)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def give_back_freed() -> None:
    """Hand the pages the C allocator holds freed back to the kernel (glibc's `malloc_trim`).
    Each feature forward allocates about 1 GB in blocks whose sizes change with the batch's
    shape, and glibc kept what was freed: over the ticket run's forwards, each under 1 GB, a
    process grew 2.6 GB. Without glibc, nothing."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class GrowthLimit:
    """Hands freed pages back (`give_back_freed`) once this process's anonymous memory has grown
    `allowance` past what it held after the first `check`; `check` after each training update.
    The first update's freed blocks stay for the next to reuse; what accumulates beyond them
    (blocks of sizes no later update asks for) goes every few updates, not every one."""

    def __init__(self, allowance: int = TRAIN_GROWTH_ALLOWANCE) -> None:
        self.allowance = allowance
        self.base: int | None = None
        self.handed_back = 0  # how many times it did

    def check(self) -> None:
        held = anonymous_bytes()
        if self.base is None:
            self.base = held
        elif held > self.base + self.allowance:
            give_back_freed()
            self.handed_back += 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - musl and others have no malloc_trim
    except (OSError, AttributeError):
        return None
    return libc
