"""FP8 (e4m3) weights through Triton: a scaled matmul for steps of many rows, and a weight-only
GEMV for batch-1 decode. Scales are float32, indexed by groups (runtime/models/fp8.py):

    weight  w  [N, K] e4m3, scale sw [ceil(N/gn), ceil(K/gk)]: w_real = w * sw[n // gn, k // gk]
    x       xq [M, K] e4m3, scale sx [M, 1] (rowwise) or [M, ceil(K/128)] (blockwise, gk = 128)

fp8_matmul: out [M, N] = sum_k xq * w * sx * sw. Grid (ceil(M/BLOCK_M), ceil(N/BLOCK_N)); each
program walks K in steps of BLOCK_K with e4m3 tensor-core dots into an fp32 accumulator.
Rowwise (gk >= K): both scales are applied once, at the end. Blockwise: BLOCK_K == gk, and each
step's partial product is scaled by sx[:, step] x sw[n // gn, step] before it is added.

fp8_rows_matmul: out [M, N] = x [M, K] (bf16 / fp16) @ (w * sw)^T for decode batches (a few to
64 rows): the weight widened to x's dtype in registers (no activation quantization), tensor-core
dots, and K split across programs so that a layer of few output tiles still fills the GPU (at
M = 64 a 4096-wide layer is 64 tiles of 64 columns on 132 SMs). Each split writes an fp32
partial; a second kernel sums them in a fixed order (deterministic, unlike atomics).

fp8_gemv: out [1, N] = x [1, K] (bf16) @ (w * sw)^T, the weight widened to fp32 in registers.
Grid (ceil(N/BLOCK_N),), laid out as kernels/gemv.py: a band of BLOCK_N rows, an fp32
[BLOCK_N, BLOCK_K] accumulator reduced once at the end.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from weft.kernels._attn import dot
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
def _fp8_rows_kernel(
    x,  # [M, K] bf16 / fp16
    w,  # [N, K] e4m3
    scale,  # [ceil(N / GROUP_N), ceil(K / GROUP_K)]
    out,  # [SPLIT, M, N] fp32 partials, or [M, N] when SPLIT == 1
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,  # a multiple of BLOCK_K (blockwise) or >= K (ROWWISE)
    ROWWISE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,  # see _attn.dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_x
    w_rows = w + offs_n[:, None].to(tl.int64) * stride_w
    s_rows = scale + (offs_n // GROUP_N) * stride_s
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k_lo + k_step + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = dot(xt, tl.trans(wt.to(xt.dtype)), UPCAST, "tf32")
        if ROWWISE:
            acc += part
        else:
            s = tl.load(s_rows + (k_lo + k_step) // GROUP_K, mask=n_mask, other=0.0)
            acc += part * s[None, :]
    if ROWWISE:
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[None, :]
    mn = offs_m[:, None] * N + offs_n[None, :]
    dst = out + tl.program_id(2).to(tl.int64) * M * N + mn
    tl.store(dst, acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(part, out, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        acc += tl.load(part + i * MN + offs, mask=mask, other=0.0)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


ROWS_BLOCK_N = 64
ROWS_BLOCK_K = 128  # the scale block: a blockwise weight's K tiles never straddle two
ROWS_MIN_STEPS = 4  # K tiles per split at least (fewer: the partials cost more than they save)
ROWS_WAVES = 4  # programs per SM aimed at: enough loads in flight to stream the weight


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # (the interpreter: a few splits, to test them)
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_tiles(
    m: int, n: int, k: int, sms: int, block_n: int = ROWS_BLOCK_N
) -> tuple[int, int, int]:
    """(block_m, splits, k per split) for M rows: the splits of K that bring the programs to
    ROWS_WAVES per SM, each at least ROWS_MIN_STEPS tiles of K. NOTE: from one sweep on an
    H100 (benchmarks/bench_kernels.py --fp8-rows); not tuned per layer."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, ROWS_BLOCK_K)
    split = max(1, min(steps // ROWS_MIN_STEPS, triton.cdiv(ROWS_WAVES * sms, tiles)))
    per_split = triton.cdiv(steps, split)
    return block_m, triton.cdiv(steps, per_split), per_split * ROWS_BLOCK_K


def fp8_rows_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: tuple[int, int],
    *,
    splits: int | None = None,
    block_n: int = ROWS_BLOCK_N,
    num_warps: int = 4,
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ (weight [N, K] e4m3 scaled in groups `group`)^T -> [M, N] in
    x's dtype, fp32 accumulation. Blockwise groups (gk < K) must be multiples of 128 columns.
    splits: of K (default: rows_tiles' choice for block_n); block_n, num_warps: for sweeps.

    NOTE: every column band re-reads its rows of x (from L2); wider bands, which re-read less,
    measured no faster at 64 rows on an H100 (benchmarks/RESULTS.md)."""
    dev = x.device
    check_tensor("x", x, 2, (torch.bfloat16, torch.float16), dev)
    check(x.stride(-1) == 1, "x: rows must be contiguous, got strides {}", x.stride())
    check_tensor("weight", weight, 2, FP8, dev)
    check(weight.stride(-1) == 1, "weight: rows must be contiguous, got {}", weight.stride())
    m, k = x.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    gn, gk = group
    rowwise = gk >= k
    check(rowwise or gk % ROWS_BLOCK_K == 0, "blockwise scales: multiples of 128, got {}", gk)
    check_tensor("scale", scale, 2, F32, dev)
    check_shape("scale", scale, (-(-n // gn), 1 if rowwise else -(-k // gk)))
    out = torch.empty((m, n), dtype=x.dtype, device=dev)
    if m == 0 or n == 0:
        return out
    block_m, split, per_split = rows_tiles(m, n, k, _num_sms(dev), block_n)
    if splits is not None:
        steps = triton.cdiv(k, ROWS_BLOCK_K)
        per_split = triton.cdiv(steps, splits) * ROWS_BLOCK_K
        split = triton.cdiv(k, per_split)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fp8_rows_kernel[grid](
        x,
        weight,
        scale,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        per_split,
        GROUP_N=gn,
        GROUP_K=gk,
        ROWWISE=rowwise,
        SPLIT=split,
        UPCAST=dev.type == "cpu",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=ROWS_BLOCK_K,
        num_warps=num_warps,
        num_stages=4,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT=split, BLOCK=block)
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
