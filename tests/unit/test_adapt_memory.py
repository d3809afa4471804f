"""adapt's memory plan (drafter/memory.py): as many workers as fit below Ray's kill threshold
beside what runs, then smaller batches and sequences, else one line saying why not. The plan's
estimate against measured peaks is checked on real Ray Train workers beside serving engines in
tests/integration/test_mismatched_arm_live.py."""

import json
import os
import time
from pathlib import Path

import pytest

from specserve.drafter import memory
from specserve.drafter.memory import MemoryPlanError, NodeMemory, Sequences, Sizes, TargetShape

GB = 2**30
# The embedded target's shape (SmolLM2-135M) in float32, as the features run on an AVX2 CPU.
TARGET = TargetShape(
    layers=30,
    hidden=576,
    intermediate=1536,
    heads=9,
    vocab=49152,
    weight_bytes=538 * 2**20,
    file_bytes=269 * 2**20,
)
SIZES = Sizes(batch_tokens=4096, max_len=3072, tokens_per_update=512, steps=3, draft_vocab=8192)
SHORT = Sequences(longest=300, mean=200.0, per_shard=60)
LONG = Sequences(longest=3000, mean=1800.0, per_shard=256)


def node(room_gb: float, total_gb: float = 24, threshold: float = 0.95) -> NodeMemory:
    used = int(total_gb * GB * threshold - room_gb * GB)
    return NodeMemory("n", int(total_gb * GB), used, threshold)


def test_the_room_is_what_lies_below_rays_kill_threshold():
    assert node(5).room == pytest.approx(5 * GB, abs=2)
    assert NodeMemory("n", 10 * GB, 10 * GB, 0.95).room == 0  # past it already: none


def test_every_worker_asked_for_fits_where_there_is_room():
    per_worker = memory.worker_bytes(TARGET, SHORT, SIZES)
    assert 1.5 * GB < per_worker < 3 * GB  # the measured peaks: 1.9-2.2 GB (docs/drafters.md)
    plan = memory.plan(2, [node(10)], TARGET, SHORT, SIZES)
    assert (plan.workers, plan.sizes, plan.note) == (2, SIZES, "")
    assert "2 workers of ~" in plan.describe()


def test_fewer_workers_where_the_room_holds_fewer():
    per_worker = memory.worker_bytes(TARGET, SHORT, SIZES)
    room = per_worker * (1 + memory.MARGIN) * 1.5 / GB  # one and a half workers' worth
    plan = memory.plan(2, [node(room)], TARGET, SHORT, SIZES)
    assert plan.workers == 1 and plan.sizes == SIZES and plan.note == "2 asked"
    # Two nodes with that room each: one worker on each.
    assert memory.plan(2, [node(room), node(room)], TARGET, SHORT, SIZES).workers == 2


def test_long_sequences_take_smaller_batches_then_shorter_sequences_before_a_refusal():
    full = memory.worker_bytes(TARGET, LONG, SIZES)
    assert full > memory.worker_bytes(TARGET, SHORT, SIZES)  # scores and held states grow
    smaller = Sizes(1024, 3072, 512, 3, 8192)
    room = memory.worker_bytes(TARGET, LONG, smaller) * (1 + memory.MARGIN) / GB + 0.01
    plan = memory.plan(2, [node(room)], TARGET, LONG, SIZES)
    assert plan.workers == 1 and plan.sizes.batch_tokens < SIZES.batch_tokens
    assert plan.sizes.max_len == SIZES.max_len
    assert "feature batches of 1024 tokens, not 4096" in plan.note
    shortest = Sizes(1024, 1024, 512, 3, 8192)
    room = memory.worker_bytes(TARGET, LONG, shortest) * (1 + memory.MARGIN) / GB + 0.01
    plan = memory.plan(2, [node(room)], TARGET, LONG, SIZES)
    assert plan.sizes == shortest and "sequences cut to their last 1024 tokens" in plan.note


def test_no_room_for_one_worker_is_one_line_that_says_what_would_fit():
    with pytest.raises(MemoryPlanError) as refused:
        memory.plan(2, [node(0.5)], TARGET, LONG, SIZES)
    message = str(refused.value)
    assert "\n" not in message and "Ray's kill threshold (95% of its memory)" in message
    assert "no node has more than 0.5 GB" in message


def test_this_nodes_memory_and_the_threshold_ray_kills_at(monkeypatch):
    here = memory.node_memory("here")
    assert 0 < here.used < here.total and here.threshold == memory.RAY_DEFAULT_THRESHOLD
    monkeypatch.setenv(memory.RAY_THRESHOLD_ENV, "0.8")
    assert memory.node_memory("here").threshold == 0.8


# A container's view: its own memory cgroup (v1) mounted as /sys/fs/cgroup/memory in a mount
# namespace of its own, as a container runtime (and tests/cluster/kubelet.py) sets it up.
IN_CONTAINER = """
set -e
echo $$ > {cgroup}/cgroup.procs
mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
mkdir /sys/fs/cgroup/memory
mount -t cgroup -o memory memory /sys/fs/cgroup/memory
mount --bind {cgroup} /sys/fs/cgroup/memory
exec {python} -c 'import json; from dataclasses import asdict; from specserve.drafter import \
memory; print(json.dumps(asdict(memory.node_memory("pod"))))'
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory/cgroup.procs").exists(),
    reason="needs root and the cgroup v1 memory controller",
)
def test_in_a_pod_the_node_is_its_memory_cgroup_as_ray_reads_it(tmp_path):
    """On a cgroup v1 node (a pod's limit in memory.limit_in_bytes), adapt plans in the pod's
    limit, not the machine's: it once read cgroup v2 alone, and planned in the machine's 24 GB
    inside a 6 GB pod."""
    import subprocess
    import sys
    import uuid

    cgroup = Path("/sys/fs/cgroup/memory") / f"specserve-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(3 * GB))
        script = IN_CONTAINER.format(cgroup=cgroup, python=sys.executable)
        run = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        cgroup.rmdir()
    assert run.returncode == 0, run.stderr[-2000:]
    seen = NodeMemory(**json.loads(run.stdout.strip().splitlines()[-1]))
    assert seen.total == 3 * GB
    # What the process uses (Python, torch and Ray imported), not the machine's used memory.
    assert 0 < seen.used < 1 * GB
    assert seen.room == pytest.approx(0.95 * 3 * GB - seen.used, abs=2)


def test_the_targets_shape_and_weights_come_from_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,'
        ' "num_attention_heads": 2, "vocab_size": 32, "dtype": "bfloat16"}'
    )
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    shape = TargetShape.of(str(tmp_path), 4)
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 8, 32)
    assert (shape.weight_bytes, shape.file_bytes) == (2000, 1000)


def test_sequences_summarise_lengths_and_a_shards_size():
    assert Sequences.of([100, 300], per_shard=256) == Sequences(300, 200.0, 2)
    assert Sequences.of([], per_shard=256) == Sequences(0, 0.0, 0)


# One adapt worker's feature stage in a process of its own, on the embedded target: peak resident
# memory after loading the target and after the forwards.
PROBE = """
import json, random, resource, sys
import torch
from transformers import AutoConfig
from specserve.drafter.data import _feature_model, features_batched
from specserve.drafter.model import DrafterConfig

target, lengths, answer, batch = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:5])
layers = DrafterConfig.for_target(AutoConfig.from_pretrained(target)).aux_layer_ids
model = _feature_model(target, 1)
loaded = int(open("/proc/self/statm").read().split()[1]) * 4096
rng = random.Random(0)
sequences = [([rng.randrange(100, 40000) for _ in range(n)], n - answer) for n in lengths]
records = features_batched(model, sequences, layers, batch)
assert all(r is not None for r in records)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"loaded": loaded, "peak": peak}))
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("lengths", "answer"),
    [
        ([1700] * 4, 200),  # prompts 3-4x the proof's, two to a 4,096-token forward
        ([2670] * 2, 200),  # a replayed answer's length, one to a forward
    ],
    ids=["long", "replayed"],
)
def test_the_estimate_holds_a_workers_measured_peak(lengths, answer):
    """Sequences as a worker computes their states: the measured peak stays under the plan's
    estimate of the whole worker, and what the forwards add under its estimate of a forward."""
    import subprocess
    import sys

    from specserve.config.schema import load_config
    from specserve.config.settings import DEFAULT_CONFIG_PATH
    from specserve.models import resolve_model_source

    target = resolve_model_source(load_config(DEFAULT_CONFIG_PATH).config.model.source)
    batch = 4096
    run = subprocess.run(
        [sys.executable, "-c", PROBE, target, json.dumps(lengths), str(answer), str(batch)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    shape = TargetShape.of(target)
    data = Sequences.of(lengths, per_shard=len(lengths))
    sizes = Sizes(batch, 3072, 512, 3, 8192)
    worker = memory.worker_bytes(shape, data, sizes)
    forward = memory.forward_bytes(shape, data, sizes)
    added = measured["peak"] - measured["loaded"]
    print(f"peak {measured['peak'] / GB:.2f} GB (estimate {worker / GB:.2f}), forwards")
    print(f"+{added / GB:.2f} GB (estimate {forward / GB:.2f})")
    assert measured["peak"] <= worker and added <= forward


# adapt's training stage in a process of its own: the shipped drafter on the target's embedding,
# trained on sequences of a replayed answer's length (one to a forward); what it adds.
TRAINING_PROBE = """
import json, sys, tempfile
from pathlib import Path
from specserve.bench.train_speed import synthetic_records
from specserve.drafter import memory
from specserve.drafter.model import Drafter
from specserve.drafter.train import TrainConfig, target_weights, train

target, base = sys.argv[1:3]
model_config = Drafter.from_pretrained(base).config
records = synthetic_records(24, 2048, 160, model_config, spread=0.3)
before = memory.anonymous_bytes()
with memory.AnonymousPeak() as used:
    model = Drafter.from_pretrained(base, target_weights(target)["embed"])
    config = TrainConfig(updates=4, lr=3e-4, validate_every=1 << 30, checkpoint_every=1 << 30)
    train(model, records, Path(tempfile.mkdtemp()), config, desc="probe")
print(json.dumps({"added": used.peak - before}))
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_training_adds_no_more_than_its_estimate():
    """The drafter's state and an update's tensors, measured, against `training_bytes`."""
    import subprocess
    import sys

    from specserve.config.schema import load_config
    from specserve.config.settings import DEFAULT_CONFIG_PATH
    from specserve.drafter.model import Drafter
    from specserve.models import resolve_drafter_source, resolve_model_source

    target = resolve_model_source(load_config(DEFAULT_CONFIG_PATH).config.model.source)
    base = resolve_drafter_source("package://eagle3.1")
    run = subprocess.run(
        [sys.executable, "-c", TRAINING_PROBE, target, base],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    added = json.loads(run.stdout.strip().splitlines()[-1])["added"]
    config = Drafter.from_pretrained(base).config
    sizes = Sizes(4096, 3072, 512, 3, config.draft_vocab_size, memory.checkpoint_params(base))
    data = Sequences.of([2048], per_shard=24)
    estimate = memory.training_bytes(TargetShape.of(target), data, sizes)  # this CPU's dtype
    print(f"training added {added / GB:.2f} GB (estimate {estimate / GB:.2f})")
    assert 0.3 * estimate < added <= estimate


def test_the_plan_counts_the_replayed_answers_beside_the_captured_rows(tmp_path):
    """The replayed build answers go through the workers' forwards too: the plan sizes them
    by the longest of both (it once counted the captured rows alone, 240 tokens, and a worker
    went past its estimate on a 2,670-token replayed answer)."""

    from transformers import AutoTokenizer

    from specserve.config.schema import load_config
    from specserve.config.settings import DEFAULT_CONFIG_PATH
    from specserve.drafter.adapt import planned_sequences
    from specserve.drafter.data import _ids
    from specserve.models import resolve_model_source

    target = resolve_model_source(load_config(DEFAULT_CONFIG_PATH).config.model.source)
    captured = {"prompt_token_ids": [7] * 150, "output_token_ids": [8] * 90}
    rows = {"training": [captured] * 3, "validation": [captured], "held_out": []}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    replay = tmp_path / "replay"
    replay.mkdir()
    manual = [
        {"role": "user", "content": "Summarise the manual."},
        {"role": "assistant", "content": "The manual says: " + "options and flags, " * 600},
    ]
    unanswered = [{"role": "user", "content": "What is this?"}]
    (replay / "answers.jsonl").write_text(
        "\n".join(json.dumps({"messages": m}) for m in (manual, unanswered)) + "\n"
    )
    spec = {"rows": str(tmp_path / "rows.json")}

    alone = planned_sequences(spec, target)
    both = planned_sequences(spec | {"replay": {"source": str(replay), "count": 1}}, target)

    assert alone.longest == 240 and alone.mean == 240
    tokens = _ids(AutoTokenizer.from_pretrained(target).apply_chat_template(manual, tokenize=True))
    assert both.longest == len(tokens) > 2000  # the unanswered one is not computed
    assert both.mean == (4 * 240 + len(tokens)) / 5


def test_the_peak_is_this_processs_anonymous_memory_while_the_block_ran():
    before = memory.anonymous_bytes()
    with memory.AnonymousPeak(period_s=0.01) as used:
        block = bytearray(200 * 2**20)  # zero-filled: resident
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.1)  # held a while, as a forward's tensors are
        del block
    assert used.peak >= before + 150 * 2**20
    assert memory.anonymous_bytes() < used.peak  # it was given back: a peak, not the end


@pytest.mark.skipif(memory._glibc() is None, reason="malloc_trim is glibc's")
def test_training_hands_freed_pages_back_once_the_process_grew_past_its_allowance():
    """`GrowthLimit` keeps what one update freed (the next reuses it) and hands the rest back
    once the process holds more than its allowance past where the first update left it."""
    memory.give_back_freed()  # what earlier tests freed would serve the blocks below
    limit = memory.GrowthLimit(allowance=64 * 2**20)
    limit.check()  # the first update's end: the base
    small = [bytearray(2000) for _ in range(20_000)]  # 40 MB of heap blocks, then freed
    del small
    limit.check()  # within the allowance: kept for the next update to reuse
    assert limit.handed_back == 0
    # 120 MB in blocks under glibc's mmap threshold (the heap's), then one more above them:
    # free() trims only the heap's top, so the freed 120 MB stay held below it.
    small = [bytearray(2000) for _ in range(60_000)]
    last = bytearray(2000)
    del small
    grown = memory.anonymous_bytes() - limit.base
    limit.check()  # past the allowance: handed back
    assert grown > 100 * 2**20
    assert limit.handed_back == 1
    assert memory.anonymous_bytes() - limit.base < grown - 80 * 2**20
    del last


@pytest.mark.parametrize(
    ("failure", "kept", "says"),
    [
        # The plan's refusal, before any worker starts: adapt raises it as its one line.
        (
            MemoryPlanError("adapt does not fit: one worker needs ~3.1 GB"),
            "REFUSED",
            "adapt does not fit: one worker needs ~3.1 GB",
        ),
        # Ray's memory monitor killing a worker once training started.
        (
            RuntimeError("Task was killed due to the node running low on memory."),
            "FAILED",
            "RuntimeError: Task was killed due to the node running low on memory.",
        ),
    ],
)
def test_why_trainings_own_process_stopped_reaches_the_caller(
    tmp_path, monkeypatch, failure, kept, says
):
    """Training runs in a process of its own, whose exit code alone says nothing: why it
    stopped is left in its out dir for adapt to raise (and the loop to print, exit code 2)."""
    from specserve.drafter import adapt

    def stop(config, spec):  # noqa: ARG001
        raise failure

    monkeypatch.setattr(adapt, "_train_on_ray", stop)
    spec = {"out": str(tmp_path / "train")}
    with pytest.raises(type(failure)):
        adapt.train_on_ray(None, spec)
    assert [p.name for p in (tmp_path / "train").iterdir()] == [getattr(adapt, kept)]
    assert (tmp_path / "train" / getattr(adapt, kept)).read_text() == says
