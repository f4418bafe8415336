"""Fused mixture-of-experts MLP: top-k routing, then grouped GEMMs over the tokens of each expert.

    x [T, H], router_logits [T, E]
      -> weights, ids [T, k]                    softmax over E, top-k (renormalised on request)
      -> entries t * k + j grouped by expert    each group padded to a multiple of BLOCK_M
      -> inter [T*k, I] = silu(x @ gate_e^T) * (x @ up_e^T)     kernel 1, w13 [E, 2I, H]
      -> y [T*k, H] = weight * inter @ down_e^T                 kernel 2, w2 [E, H, I]
      -> out [T, H] = sum over the k rows of each token

The grouping (kernels/moe_routing.py) lays the entries of each expert out in blocks of BLOCK_M
rows. Each program of a kernel here takes one block (rows of one expert) and one BLOCK_N band of
the output features, and streams that band of the expert's weight once: a step reads only the
weights of the experts its tokens chose. Launch sizes come from T alone (padded to the worst
case), so a CUDA graph captured at T replays for any routing; blocks past the used ones see
expert E and return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.kernels._attn import dot
from weft.kernels._checks import FLOAT_DTYPES, check, check_shape, check_tensor, dot_mode
from weft.kernels.moe_routing import align_by_expert, topk_softmax


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """Tiles from T alone (a CUDA graph captured at T keeps them).

    Decode (at most ~16 rows per expert on average; Qwen3-30B-A3B at T <= 64 has 4): each block
    is one expert's few rows padded to 16 (tl.dot's smallest M), and the step is a stream of the
    chosen experts' weights: narrow N bands (32) give many programs in flight per SM, as in the
    GEMV kernel, and the padded rows cost tensor-core work that is free while memory-bound.
    Prefill (many rows per expert): the GEMMs become compute-bound: 64-row blocks reuse each
    weight tile over 64 tokens, 64-wide N bands and K steps keep both fp32 accumulators of the
    gate/up kernel in registers.
    NOTE: a first choice, untuned on hardware: benchmarks/bench_moe.py --sweep compares others.
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if per_expert <= 32:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return MoeTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


@triton.jit
def _gate_up_kernel(
    x,  # [T, H]
    w13,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    sorted_entries,  # [P]
    block_expert,  # [P / BLOCK_M]
    inter,  # [T * k, I] out: silu(gate) * up per entry
    num_entries,
    num_experts,
    H,
    INTER,
    stride_xt,
    stride_we,
    stride_wn,
    stride_it,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block).to(tl.int64)
    if expert >= num_experts:
        return  # past the used blocks
    entries = tl.load(sorted_entries + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entries < num_entries
    rows = (entries // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    gate_rows = w13 + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(
            x + rows[:, None] * stride_xt + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(gate_rows + offs_k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        w_up = tl.load(up_rows + offs_k[:, None], mask=w_mask, other=0.0)
        acc_gate += dot(a, w_gate, UPCAST, PRECISION)
        acc_up += dot(a, w_up, UPCAST, PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = inter + entries[:, None].to(tl.int64) * stride_it + offs_n[None, :]
    tl.store(out, act.to(inter.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter,  # [T * k, I]
    w2,  # [E, H, I]
    sorted_entries,  # [P]
    block_expert,  # [P / BLOCK_M]
    weights,  # [T * k] float32 routing weights
    y,  # [T * k, H] out: weight * inter @ down^T per entry
    num_entries,
    num_experts,
    H,
    INTER,
    stride_it,
    stride_we,
    stride_wn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block).to(tl.int64)
    if expert >= num_experts:
        return
    entries = tl.load(sorted_entries + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entries < num_entries
    rows = entries.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_rows = w2 + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < INTER
        a = tl.load(
            inter + rows[:, None] * stride_it + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(w_rows + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(a, w, UPCAST, PRECISION)
    acc *= tl.load(weights + rows, mask=valid, other=0.0)[:, None]
    out = y + rows[:, None] * stride_yt + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j] -> [T, H].

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (both with unit stride along the last dim);
    weights [T, k] float32; ids [T, k] int (values in 0..E-1: unchecked, they live on the device).
    """
    dev = x.device
    check_tensor("x", x, 2, FLOAT_DTYPES, dev)
    check_tensor("w13", w13, 3, (x.dtype,), dev)
    check_tensor("w2", w2, 3, (x.dtype,), dev)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    check(two_inter % 2 == 0, "w13: dim 1 ({}) must be even (gate and up rows)", two_inter)
    inter_size = two_inter // 2
    check_shape("w13", w13, (num_experts, two_inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, inter_size))
    check_tensor("ids", ids, 2, (torch.int32, torch.int64), dev, last_contiguous=False)
    top_k = ids.shape[1]
    check_shape("ids", ids, (num_tokens, top_k))
    check_tensor("weights", weights, 2, (torch.float32,), dev, last_contiguous=False)
    check_shape("weights", weights, (num_tokens, top_k))
    n = num_tokens * top_k
    if n == 0 or hidden == 0:
        return torch.zeros_like(x)
    t = tiles or default_tiles(num_tokens, top_k, num_experts)
    sorted_entries, block_expert = align_by_expert(ids, num_experts, t.block_m)
    num_blocks = block_expert.numel()
    upcast, precision = dot_mode(x.dtype, dev)
    inter = torch.empty((n, inter_size), dtype=x.dtype, device=dev)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, t.block_n))](
        x,
        w13,
        sorted_entries,
        block_expert,
        inter,
        n,
        num_experts,
        hidden,
        inter_size,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        TOP_K=top_k,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    y = torch.empty((n, hidden), dtype=x.dtype, device=dev)
    _down_kernel[(num_blocks, triton.cdiv(hidden, t.block_n))](
        inter,
        w2,
        sorted_entries,
        block_expert,
        weights.contiguous().view(-1),
        y,
        n,
        num_experts,
        hidden,
        inter_size,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    # NOTE: a sum over k rows (fp32 inside), not atomics into [T, H]: the result is deterministic
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """x [T, H], router_logits [T, E] -> [T, H]: the MoE MLP (twin: fused_moe_ref.fused_moe_ref)."""
    check_shape("router_logits", router_logits, (x.shape[0], w13.shape[0]))
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, tiles=tiles)
