"""Dynamic FP8 activation quantization in one kernel: x [M, K] -> e4m3 [M, K] and float32 scales
[M, G], one per row and group of `group` columns (group >= K: one per row), scale = amax / 448.

Grid (M, G): a program reads its row's group twice (the amax, then the quantization) in BLOCK-wide
tiles, and writes it once: the torch twin (runtime/models/fp8.quantize_rows) makes ~8 passes over
an fp32 copy of x, which at prefill (8192 rows of 4096) costs more than the matmul's own reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_tensor, next_pow2

FP8_MAX = 448.0
MIN_AMAX = 1e-12  # runtime/models/fp8.MIN_AMAX: a row of zeros gets a nonzero scale
# NOTE: compiled Triton reads only constexpr globals in a kernel (the interpreter reads any)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _quant_kernel(
    x,  # [M, K]
    q,  # [M, K] e4m3
    scale,  # [M, G] float32
    K,
    group,
    stride_x,
    stride_q,
    stride_s,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    x_row = x + row.to(tl.int64) * stride_x
    q_row = q + row.to(tl.int64) * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, group, BLOCK):
        offs = start + k0 + tl.arange(0, BLOCK)
        mask = (k0 + tl.arange(0, BLOCK) < group) & (offs < K)
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl.maximum(tl.max(amax, 0), _MIN_AMAX) / _FP8_MAX
    tl.store(scale + row * stride_s + g, s)
    for k0 in range(0, group, BLOCK):
        offs = start + k0 + tl.arange(0, BLOCK)
        mask = (k0 + tl.arange(0, BLOCK) < group) & (offs < K)
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        qv = tl.minimum(tl.maximum(v / s, -_FP8_MAX), _FP8_MAX)
        tl.store(q_row + offs, qv.to(q.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float) -> (e4m3 [M, K], float32 scales [M, 1] or [M, ceil(K/group)])."""
    check_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    m, k = x.shape
    group = k if group is None or group >= k else group
    check(group > 0, "group must be > 0, got {}", group)
    groups = -(-k // group) if k else 1
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale.fill_(MIN_AMAX / FP8_MAX)
    block = min(1024, next_pow2(group))
    _quant_kernel[(m, groups)](
        x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0), BLOCK=block
    )
    return q, scale
