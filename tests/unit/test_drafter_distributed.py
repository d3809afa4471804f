"""Data-parallel training (torchrun, gloo, two processes) ends with the weights single-process
training reaches on the same data and seed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.drafter.train import TrainConfig, train
from tests.conftest import free_port
from tests.unit.test_drafter_train import drafter, sequence

ROOT = Path(__file__).resolve().parents[2]
# Several sequences per update, an odd count in some, so the two ranks get unequal shares.
# One sequence per forward in both runs: each rank batches only its own share of an update, and
# bf16 products of other batch shapes round differently (batched against one-by-one is checked
# in float32 in test_drafter_train.py).
CONFIG = TrainConfig(epochs=2, tokens_per_update=80, lr=1e-2, checkpoint_every=1000, batch_tokens=0)


def training_set() -> list[dict]:
    return [sequence(i, length=30 + i % 7) for i in range(12)]


@pytest.mark.ray  # torchrun
def test_two_processes_match_one(tmp_path):
    single = train(drafter(), training_set(), tmp_path / "single", CONFIG).state_dict()

    out = tmp_path / "ddp" / "weights.pt"
    out.parent.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "tests.unit.ddp_worker", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    parallel = torch.load(out)

    moved = 0.0
    for name, weights in single.items():
        if weights.is_floating_point():
            torch.testing.assert_close(parallel[name], weights, rtol=1e-4, atol=1e-4)
            moved = max(moved, float((weights - drafter().state_dict()[name]).abs().max()))
    assert moved > 1e-2  # the weights did train: the comparison is not of two fresh models
