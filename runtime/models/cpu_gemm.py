"""bfloat16 matrix products on a CPU without bfloat16 in hardware (AVX2, AVX-512 without
AVX512_BF16): multiplied in float32, the weight widened a band of rows at a time.

Such a CPU emulates a bfloat16 GEMM at about a quarter of its float32 rate (2-core AMD EPYC capped
to AVX2, 9728 x 896 weight, 128 rows: 105 ms bf16, 28 ms float32; RESULTS.md, issue 21), so
prefill ran at ~25 prompt tokens a second. A float32 copy of every weight would double a
model's memory; widening the whole weight per call costs a full write and read of it (46 ms).
A band of rows widened into a small buffer stays in the core's caches while the GEMM reads it:
as fast as a stored float32 weight (24 ms). A few rows (decode) are bound by reading the
weight, where bfloat16 reads half the bytes: those stay in bfloat16.
"""

from __future__ import annotations

import functools
import threading

import torch

from weft.runtime.hardware import cpu_bf16_flags

# From this many rows on, the float32 product is faster (the shape above, 1 thread, quiet: 2 rows
# bf16 1.6 vs 2.1 ms; 4 rows 3.2 vs 2.9; 8 rows 6.6 vs 3.5; 16 rows 14.0 vs 4.7)
F32_MIN_ROWS = 4
BAND_BYTES = 4 << 20  # float32 bytes of weight widened at a time: within a core's L2 + L3 share

_buffers = threading.local()  # NOTE: per thread: in-process engines may run forwards side by side
# NOTE: off unless asked for (EngineConfig.cpu_float32_products): a step's products then round
# differently by its row count (bf16 below F32_MIN_ROWS, float32 from it), and greedy or logprob
# comparisons across step shapes (jump-forward on / off, a select's scores against the whole
# text's) differ at near-ties on such a CPU; tests/test_frontend/test_programs.py's select
# check did, under ATEN_CPU_CAPABILITY=avx2. On by default once the suite passes there.
_enabled = False


def enable(on: bool) -> None:
    """Turn the float32 products on or off for this process (the model runner, at load)."""
    global _enabled
    _enabled = on


def widen_bf16_gemm() -> bool:
    """Whether bfloat16 products of F32_MIN_ROWS rows or more run in float32 on this CPU."""
    return _enabled and _no_bf16()


@functools.cache
def _no_bf16() -> bool:
    return not cpu_bf16_flags()


def wants_f32(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.shape[0] >= F32_MIN_ROWS
        and widen_bf16_gemm()
    )


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ weight [N, K] bf16 ^T (+ bias) computed in float32, returned in bf16."""
    n, k = weight.shape
    rows = max(16, BAND_BYTES // (4 * k))
    x32 = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    band = _band(rows, k)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        wide = band[: hi - lo]
        wide.copy_(weight[lo:hi])
        torch.mm(x32, wide.t(), out=out[:, lo:hi])
    if bias is not None:
        out += bias
    return out.to(torch.bfloat16)


def _band(rows: int, k: int) -> torch.Tensor:
    band = getattr(_buffers, "band", None)
    if band is None or band.numel() < rows * k:
        band = _buffers.band = torch.empty(rows * k, dtype=torch.float32)
    return band[: rows * k].view(rows, k)
