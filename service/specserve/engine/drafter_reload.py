"""Load another drafter's weights into a running engine: a promotion without a restart.

vLLM's workers take `DrafterReload`'s methods (the engine argument `worker_extension_cls`, set
for every EAGLE arm in engine/arm.py), and the arm's replica calls them through the engine's
collective RPC (`ArmServer.reconfigure`, engine/front.py). The engine core runs such a call
between two of its steps, so no step drafts with half-loaded weights. The weights go through
vLLM's own in-place reload, which runs each layer's post-load processing again: the CPU backend
packs its linear weights there, and a plain copy into the parameters would leave the packed
copies it computes with untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from specserve.drafter_checkpoint import misfit, safetensors_files

if TYPE_CHECKING:
    import torch

# The worker method's name, and the class vLLM mixes into its workers.
RELOAD_DRAFTER = "reload_drafter"
WORKER_EXTENSION = f"{__name__}.DrafterReload"


def local_checkpoint(source: str, revision: str | None = None) -> str:
    """The directory a drafter was loaded from: `source` itself, or a hub repository's copy
    (at `revision`) in the local cache, where vLLM downloaded it when the engine started."""
    if Path(source).is_dir():
        return source
    from huggingface_hub import snapshot_download

    return snapshot_download(source, revision=revision, local_files_only=True)


def _tensors(checkpoint: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(checkpoint):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118  # safe_open is no mapping
                yield name, tensors.get_tensor(name)


class DrafterReload:
    """Worker methods; vLLM mixes this class into its worker class."""

    def reload_drafter(self, checkpoint: str, started_from: str) -> dict[str, Any]:
        """Load the drafter checkpoint at `checkpoint` (a directory) into the running drafter,
        loaded at start from `started_from`, whose tensor names and shapes it must have."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        problem = misfit(checkpoint, started_from)
        if problem:
            raise ValueError(problem)
        runner = self.model_runner  # type: ignore[attr-defined]
        drafter = runner.drafter
        # What the reload reads of a config: the drafter's model config, not the target's.
        config = SimpleNamespace(
            model_config=drafter.speculative_config.draft_model_config,
            load_config=runner.vllm_config.load_config,
            lora_config=None,
        )
        # Read whole before any layer changes (a drafter is tens of MB): a file that cannot be
        # read fails here, with the running weights untouched.
        tensors = list(_tensors(checkpoint))
        reload_weights(
            config,  # type: ignore[arg-type]
            drafter.model,
            weights_iterator=tensors,
            weights_path=None,
            is_checkpoint_format=True,
        )
        return {"checkpoint": checkpoint}
