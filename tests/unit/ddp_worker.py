"""Run under torchrun by test_drafter_distributed.py: one process of a data-parallel training
of the tiny drafter on the synthetic sequences; rank 0 saves the trained weights to OUT."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from specserve.drafter.train import train
from tests.unit.test_drafter_distributed import CONFIG, training_set
from tests.unit.test_drafter_train import drafter

if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = train(drafter(), training_set(), out.parent / f"rank{rank}", CONFIG)
    if rank == 0:
        torch.save(model.state_dict(), out)
    # Every rank done before any tears its connections down: a peer closing its side while
    # another is still working aborted that one's process now and then (gloo, on a busy machine).
    dist.barrier()
    dist.destroy_process_group()
