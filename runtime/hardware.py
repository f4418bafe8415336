"""What the processor does in hardware, read once where a setting resolves "auto".

NOTE: no torch at import time (loaders/source.py, imported by the server's launcher, uses it).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# /proc/cpuinfo flags of an x86 CPU with bfloat16 arithmetic (dot products, AMX tiles)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


# torch's CPU kernel levels (ATEN_CPU_CAPABILITY) below AVX-512: its bfloat16 instructions unused
_NO_AVX512_LEVELS = ("default", "avx2")


def cpu_bf16_flags() -> list[str]:
    """The bfloat16 flags this CPU lists; empty: no bfloat16 in hardware. A torch capped to AVX2
    kernels (ATEN_CPU_CAPABILITY, as on a CPU without AVX-512) counts as none: that is how such
    a CPU is reproduced on one that has them."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in _NO_AVX512_LEVELS:
        return []
    return [flag for flag in BF16_FLAGS if flag in cpu_flags()]
