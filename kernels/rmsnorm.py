"""Fused RMSNorm with an optional residual add, matching runtime/models/layers.RMSNorm:

    s = x + residual                        (rounded to x's dtype: it is the next residual)
    normed = rms_norm(float32(s)) -> dtype  (rounded once, before the weight)
    out = weight * normed                   (in x's dtype)

and, with unit_offset (Gemma's norm, layers.GemmaRMSNorm), one rounding at the end instead:

    out = (rms_norm(float32(s)) * (1 + float32(weight))) -> dtype

Grid (T,): one program per row; the whole row (H <= 65536) is one block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_shape, check_tensor, next_pow2


@triton.jit
def _rmsnorm_kernel(
    x,  # [T, H]
    residual,  # [T, H] (unused without HAS_RESIDUAL)
    weight,  # [H]
    out,  # [T, H]
    residual_out,  # [T, H]: x + residual (unused without HAS_RESIDUAL)
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN  # padded lanes load 0: they add nothing to the sum of squares
    s = tl.load(x + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s_low = (s + r).to(out.dtype.element_ty)
        tl.store(residual_out + t * stride_ro + offs, s_low, mask=mask)
        s = s_low.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, 0) / HIDDEN + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = (s * inv_rms) * (1.0 + w)
    else:
        y = w * (s * inv_rms).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + t * stride_o + offs, y.to(out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual); without a residual, (weight * norm(x), x).
    unit_offset: (1 + weight) * norm(...), Gemma's (see the module docstring for the rounding).

    x [T, H] (row stride free), residual [T, H], weight [H], all of one dtype. `out` and
    `residual_out` ([T, H], new tensors unless given) may be x or residual themselves (each
    program reads its row before writing it).
    """
    dev = x.device
    check_tensor("x", x, 2, FLOAT_DTYPES, dev)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, 1, (x.dtype,), dev)
    check_shape("weight", weight, (hidden,))
    check(hidden <= 65536, "hidden size {} > 65536 does not fit one block", hidden)
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=dev)
    check_tensor("out", out, 2, (x.dtype,), dev)
    check_shape("out", out, (num_tokens, hidden))
    has_residual = residual is not None
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), dev)
        check_shape("residual", residual, (num_tokens, hidden))
        if residual_out is None:
            residual_out = torch.empty_like(out)
        check_tensor("residual_out", residual_out, 2, (x.dtype,), dev)
        check_shape("residual_out", residual_out, (num_tokens, hidden))
    else:
        residual, residual_out = x, x  # placeholders: HAS_RESIDUAL=False never touches them
    if num_tokens > 0:
        block = next_pow2(hidden)
        _rmsnorm_kernel[(num_tokens,)](
            x,
            residual,
            weight,
            out,
            residual_out,
            eps,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=has_residual,
            UNIT_OFFSET=unit_offset,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out, residual_out


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin: the same operations as layers.RMSNorm.forward (GemmaRMSNorm's with
    unit_offset)."""
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype), x
    return weight * normed.to(x.dtype), x
