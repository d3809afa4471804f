"""Ray Serve LLM's per-node start step, skipped where it has nothing to do.

Before each engine starts, Ray Serve LLM runs one Ray task per node of the replica's placement
group to copy the model's files there from a bucket. With no bucket (a local directory such as
the embedded model, or a hub id, which vLLM fetches itself) the task only hands the source back
unchanged, yet it starts a worker process of its own first: 24 s of an engine's start on a
2-core machine with busy engines (BENCHMARKS.md, "Engine start"). A bucket URI still takes it.
"""

from __future__ import annotations

import os

import torch
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.common.utils.cloud_utils import is_remote_path


class SkipNodeInitWithoutBucket(CallbackBase):
    """The callback of every arm's LLMConfig (`callback_config`)."""

    async def on_before_node_init(self) -> None:
        engine = self.llm_config.get_engine_config()
        assert engine is not None  # vLLM's, the only engine Ray Serve LLM builds
        if engine.mirror_config is None and not is_remote_path(engine.actual_hf_model_id):
            self.ctx.run_init_node = False
            # What the skipped step also does: torch cannot create its kernels cache itself
            # where the parent directory is missing.
            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
