"""FP8 (e4m3) weights through Triton: a scaled matmul for steps of many rows, and a weight-only
GEMV for batch-1 decode. Scales are float32, indexed by groups (runtime/models/fp8.py):

    weight  w  [N, K] e4m3, scale sw [ceil(N/gn), ceil(K/gk)]: w_real = w * sw[n // gn, k // gk]
    x       xq [M, K] e4m3, scale sx [M, 1] (rowwise) or [M, ceil(K/128)] (blockwise, gk = 128)

fp8_matmul: out [M, N] = sum_k xq * w * sx * sw. Grid (ceil(M/BLOCK_M), ceil(N/BLOCK_N)); each
program walks K in steps of BLOCK_K with e4m3 tensor-core dots into an fp32 accumulator.
Rowwise (gk >= K): both scales are applied once, at the end. Blockwise: BLOCK_K == gk, and each
step's partial product is scaled by sx[:, step] x sw[n // gn, step] before it is added.

fp8_gemv: out [1, N] = x [1, K] (bf16) @ (w * sw)^T, the weight widened to fp32 in registers.
Grid (ceil(N/BLOCK_N),), laid out as kernels/gemv.py: a band of BLOCK_N rows, an fp32
[BLOCK_N, BLOCK_K] accumulator reduced once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_out, check_shape, check_tensor
from weft.kernels.gemv import gemv_args

FP8 = (torch.float8_e4m3fn,)
F32 = (torch.float32,)


@triton.jit
def _fp8_matmul_kernel(
    a,  # [M, K] e4m3
    a_scale,  # [M, 1] or [M, ceil(K / BLOCK_K)]
    b,  # [N, K] e4m3
    b_scale,  # [ceil(N / GROUP_N), *]
    out,  # [M, N]
    M,
    N,
    K,
    stride_a,
    stride_as,
    stride_b,
    stride_bs,
    stride_out,
    GROUP_N: tl.constexpr,
    BLOCKWISE: tl.constexpr,  # scales per K step of BLOCK_K (else per row, applied at the end)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_rows = a + offs_m[:, None].to(tl.int64) * stride_a
    b_rows = b + offs_n[:, None].to(tl.int64) * stride_b
    sa_rows = a_scale + offs_m * stride_as
    sb_rows = b_scale + (offs_n // GROUP_N) * stride_bs
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        at = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = tl.dot(at, tl.trans(bt))
        if BLOCKWISE:
            step = k0 // BLOCK_K
            sa = tl.load(sa_rows + step, mask=m_mask, other=0.0)
            sb = tl.load(sb_rows + step, mask=n_mask, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if not BLOCKWISE:
        sa = tl.load(sa_rows, mask=m_mask, other=0.0)
        sb = tl.load(sb_rows, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    dst = out + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul_tiles(m: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for M rows (BLOCK_K is 128: the scale group).
    NOTE: a first guess, not a sweep: small tiles for decode batches, 64 x 128 beyond."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 32:
        return 32, 64, 4, 4
    return 64, 128, 4, 3


def fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    group: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 (scales [M, 1] or [M, ceil(K/128)]) @ weight [N, K] e4m3 (scales in
    groups `group` = (gn, gk): gk >= K rowwise, else gk == 128) -> [M, N] out_dtype."""
    dev = xq.device
    check_tensor("xq", xq, 2, FP8, dev)
    check_tensor("weight", weight, 2, FP8, dev)
    m, k = xq.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    gn, gk = group
    blockwise = gk < k
    check(not blockwise or gk == 128, "blockwise scales: groups of 128 columns, got {}", gk)
    groups_k = -(-k // gk) if blockwise else 1
    check_tensor("x_scale", x_scale, 2, F32, dev)
    check_shape("x_scale", x_scale, (m, groups_k))
    check_tensor("w_scale", w_scale, 2, F32, dev)
    check_shape("w_scale", w_scale, (-(-n // gn), groups_k))
    check(out_dtype in FLOAT_DTYPES, "out_dtype {} not in {}", out_dtype, FLOAT_DTYPES)
    like = torch.empty(0, dtype=out_dtype, device=dev)
    out = check_out(out, (m, n), like)
    if m == 0 or n == 0:
        return out
    tile_m, tile_n, warps, stages = matmul_tiles(m)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_matmul_kernel[grid](
        xq,
        x_scale,
        weight,
        w_scale,
        out,
        m,
        n,
        k,
        xq.stride(0),
        x_scale.stride(0),
        weight.stride(0),
        w_scale.stride(0),
        out.stride(0),
        GROUP_N=gn,
        BLOCKWISE=blockwise,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _fp8_gemv_kernel(
    x,  # [K]
    w,  # [N, K] e4m3
    scale,  # [ceil(N / GROUP_N), ceil(K / GROUP_K)]
    bias,  # [N] (unused without HAS_BIAS)
    out,  # [N]
    N,
    K,
    stride_w,
    stride_s,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,  # a multiple of BLOCK_K (blockwise) or >= K (ROWWISE)
    ROWWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w + offs_n[:, None].to(tl.int64) * stride_w
    s_rows = scale + (offs_n // GROUP_N) * stride_s
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = tl.load(x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        wt = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if ROWWISE:
            acc += wt.to(tl.float32) * xv[None, :]
        else:
            s = tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += wt.to(tl.float32) * s[:, None] * xv[None, :]
    y = tl.sum(acc, 1)
    if ROWWISE:
        y = y * tl.load(s_rows, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out + offs_n, y.to(out.dtype.element_ty), mask=n_mask)


def gemv_tiles(n: int, k: int, group_k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages). NOTE: kernels/gemv.py's bf16 rule with the
    byte width halved (1024 e4m3 columns read what 512 bf16 ones do), K tiles no wider than a
    scale block; unmeasured for e4m3: sweep on the GPU (benchmarks/bench_kernels.py's way)."""
    block_k = min(1024, max(16, 1 << (k - 1).bit_length()))
    if group_k < k:
        block_k = min(block_k, group_k)
    return (4 if n >= 16384 else 8), block_k, 8, 3


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] e4m3 scaled in groups `group`)^T (+ bias [N]) -> [1, N] in x's
    dtype (fp32 accumulation). Blockwise groups (gk < K) need block_k to divide gk."""
    out, done = gemv_args(x, weight, FP8, bias, out)
    n, k = weight.shape
    gn, gk = group
    rowwise = gk >= k
    check_tensor("scale", scale, 2, F32, x.device)
    check_shape("scale", scale, (-(-n // gn), 1 if rowwise else -(-k // gk)))
    if done:
        return out
    default_n, default_k, warps, stages = gemv_tiles(n, k, gk)
    block_n, block_k = block_n or default_n, block_k or default_k
    check(rowwise or gk % block_k == 0, "block_k {} must divide the scale group {}", block_k, gk)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        scale.stride(0),
        GROUP_N=gn,
        GROUP_K=gk,
        ROWWISE=rowwise,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def fp8_matmul_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    group: tuple[int, int],
) -> torch.Tensor:
    """The torch twin of fp8_matmul in float64: both operands dequantized, then multiplied."""
    from weft.runtime.models.fp8 import expand_scales

    m, k = xq.shape
    gk = group[1]
    x_group = (1, 128 if gk < k else k)
    x = xq.double() * expand_scales(x_scale.double(), x_group, (m, k))
    n = weight.shape[0]
    w = weight.double() * expand_scales(w_scale.double(), group, (n, k))
    return x @ w.t()


def fp8_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of fp8_gemv in float64."""
    from weft.runtime.models.fp8 import expand_scales

    n, k = weight.shape
    w = weight.double() * expand_scales(scale.double(), group, (n, k))
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()
