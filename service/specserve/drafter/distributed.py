"""Data-parallel drafter training under `torchrun`, on GPUs (NCCL) or CPUs (gloo).

    specserve drafter build --work-dir DIR ...        # data: answers and captured features
    torchrun --nproc-per-node 4 -m specserve.drafter.distributed --work-dir DIR --variant eagle3.1

Each process trains on the work dir's captured features (`features/shard-*.pt`, the same
training/validation split as `drafter build`), with the same seed and draft vocabulary;
`train` deals every update's sequences out over the processes and sums their gradients
(specserve/drafter/train.py). Rank 0 validates, checkpoints (a rerun resumes) and exports the
best weights to `<variant>-ddp/export` in the format vLLM loads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from specserve.drafter.pipeline import VARIANTS, split_validation, variant_drafter
from specserve.drafter.train import TrainConfig, load_records, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="a `drafter build` work dir")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="eagle3.1")
    parser.add_argument("--target", help="target model dir (default: the configured model)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps, help="TTT depth")
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--tokens-per-update", type=int, default=TrainConfig.tokens_per_update)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        target = args.target or _configured_target()
        shards = sorted((args.work_dir / "features").glob("shard-*.pt"))
        if not shards:
            raise SystemExit(f"{args.work_dir}/features has no shards: run `drafter build` first")
        records, validation = split_validation(load_records(shards))
        model = variant_drafter(target, records, args.variant).to(device)
        config = TrainConfig(
            epochs=args.epochs,
            steps=args.steps,
            lr=args.lr,
            tokens_per_update=args.tokens_per_update,
        )
        out = args.work_dir / f"{args.variant}-ddp"
        world = dist.get_world_size()
        train(model, records, out, config, validation=validation, desc=f"{args.variant} x{world}")
        if dist.get_rank() == 0:
            print(f"exported {model.cpu().export(out / 'export')}")
        dist.barrier()  # every rank done before any tears its connections down
    finally:
        dist.destroy_process_group()
    return 0


def _configured_target() -> str:
    from specserve.config.schema import load_config
    from specserve.config.settings import get_settings
    from specserve.models import prepare_model

    return prepare_model(load_config(get_settings().config).config.model.source)


if __name__ == "__main__":
    raise SystemExit(main())
