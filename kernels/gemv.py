"""One row through a linear layer: x [1, K] @ weight [N, K]^T (+ bias) -> [1, N], reading the
weight once at close to the copy bandwidth.

At batch 1 a decode step is the read of every weight once. For M = 1, cuBLAS picks GEMM tiles
(split-K for the small layers) that stream Llama-3.1-8B's layers at 1.8-2.7 TB/s on an H100;
this kernel streams them at 2.4-3.1 TB/s (RESULTS.md, "GEMV at batch 1").

Grid (ceil(N / BLOCK_N),): a program reads a [BLOCK_N, K] band of the weight as [BLOCK_N, BLOCK_K]
tiles, multiplies each by the matching slice of x into an fp32 [BLOCK_N, BLOCK_K] accumulator,
and reduces it over K once at the end. Small BLOCK_N gives many programs, and so many loads in
flight per SM, which a bandwidth-bound kernel needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_out, check_shape, check_tensor


@triton.jit
def _gemv_kernel(
    x,  # [K]
    w,  # [N, K]
    bias,  # [N] (unused without HAS_BIAS)
    out,  # [N]
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(x + offs_k)
            wt = tl.load(rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            xv = tl.load(x + offs_k, mask=k_mask, other=0.0)
            wt = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out + offs_n, y.to(out.dtype.element_ty), mask=n_mask)


def default_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages): a rule from a sweep on an H100 over the
    Llama-3.1-8B layers (RESULTS.md): 512-wide K tiles, and narrow N bands for wide layers."""
    block_k = min(512, max(16, 1 << (k - 1).bit_length()))
    if n >= 65536:  # the lm_head: many programs already
        return 4, block_k, 4, 2
    return (4 if n >= 16384 else 8), block_k, 8, 3


def gemv_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_dtypes: tuple[torch.dtype, ...],
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """The checks of a GEMV's x [1, K], weight [N, K], bias [N] and out [1, N] (bf16 weights
    here, e4m3 in kernels/fp8_matmul.py): (out, whether it is complete already: N or K empty)."""
    dev = x.device
    check_tensor("x", x, 2, FLOAT_DTYPES, dev)
    check(x.shape[0] == 1, "x: one row expected, got shape {}", tuple(x.shape))
    check_tensor("weight", weight, 2, weight_dtypes, dev)
    n, k = weight.shape
    check_shape("x", x, (1, k))
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,), dev)
        check_shape("bias", bias, (n,))
    out = check_out(out, (1, n), x)
    if n == 0:
        return out, True
    if k == 0:
        return (out.copy_(bias.view(1, n)) if bias is not None else out.zero_()), True
    return out, False


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias [N]) -> [1, N] in x's dtype (fp32 accumulation).
    The tiles and launch default to `default_tiles`."""
    out, done = gemv_args(x, weight, (x.dtype,), bias, out)
    n, k = weight.shape
    if done:
        return out
    default_n, default_k, default_warps, default_stages = default_tiles(n, k)
    block_n = block_n or default_n
    block_k = block_k or default_k
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps or default_warps,
        num_stages=num_stages or default_stages,
    )
    return out


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch twin."""
    return F.linear(x, weight, bias)
