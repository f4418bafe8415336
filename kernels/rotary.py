"""Rotate-half RoPE (the HF layout) from cos/sin tables, in place or out of place.

With x1 = x[..., :D/2], x2 = x[..., D/2:] and angles of position p (runtime/models/layers.Rotary):

    out[..., :D/2] = x1 * cos[p] - x2 * sin[p]
    out[..., D/2:] = x2 * cos[p] + x1 * sin[p]          (in float32, rounded once to x's dtype)

Any frequency scaling (Llama 3.1, linear) is already in the tables. Grid (T, ceil(H / BLOCK_H)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_out,
    check_shape,
    check_tensor,
    next_pow2,
)


@triton.jit
def _rotary_kernel(
    x,  # [T, H, D]
    out,  # [T, H, D], may be x itself
    cos,  # [max_pos, D/2] fp32
    sin,
    positions,  # [T]
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < HALF
    mask = (offs_h < NUM_HEADS)[:, None] & c_mask[None, :]
    pos = tl.load(positions + t).to(tl.int64)
    c = tl.load(cos + pos * stride_cos + offs_c, mask=c_mask, other=0.0)[None, :]
    s = tl.load(sin + pos * stride_sin + offs_c, mask=c_mask, other=0.0)[None, :]
    src = x + t * stride_xt + offs_h[:, None] * stride_xh + offs_c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # NOTE: in place is safe: this program loads both halves of its rows before storing them,
    # and no other program touches those rows.
    dst = out + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=mask)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE of x [T, H, D] at positions [T] -> out [T, H, D] (a new tensor unless given).

    x may be a strided view (q and k of a fused qkv output: token and head strides free);
    cos/sin [max_pos, D/2] float32. Pass `out=x` to rotate in place; any other `out` must not
    overlap x. Positions must be < max_pos (not checked: they live on the device).
    """
    dev = x.device
    check_tensor("x", x, 3, FLOAT_DTYPES, dev)
    num_tokens, num_heads, head_dim = x.shape
    check(head_dim % 2 == 0, "head_dim {} must be even", head_dim)
    half = head_dim // 2
    check_tensor("cos", cos, 2, (torch.float32,), dev)
    check_tensor("sin", sin, 2, (torch.float32,), dev)
    check_shape("cos", cos, (cos.shape[0], half))
    check_shape("sin", sin, tuple(cos.shape))
    check_tensor("positions", positions, 1, INDEX_DTYPES, dev)
    check_shape("positions", positions, (num_tokens,))
    out = check_out(out, (num_tokens, num_heads, head_dim), x)
    if num_tokens == 0:
        return out
    block_half = next_pow2(half)
    block_h = min(next_pow2(num_heads), max(1, 2048 // block_half))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x,
        out,
        cos,
        sin,
        positions,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return out


def apply_rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The torch twin: Rotary.lookup + Rotary.rotate of runtime/models/layers.py."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
