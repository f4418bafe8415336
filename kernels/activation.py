"""SiLU-and-mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], rounded like the torch expression
`F.silu(gate) * up` in x's dtype (silu rounded to the dtype, then the product); with
gelu_tanh, `F.gelu(gate, approximate="tanh") * up` (Gemma's MLP) the same way.

Grid (T, ceil(I / BLOCK)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_out, check_tensor, next_pow2


@triton.jit
def _silu_and_mul_kernel(
    x,  # [T, 2I]
    out,  # [T, I]
    stride_x,
    stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + t * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), |tanh(u)| = (1 - e) / (1 + e)
        # with e = exp(-2|u|) <= 1 (no overflow). NOTE: the tanh form, not the equal
        # g * sigmoid(2u): tanh saturates to -1 (e underflows) and the result is exactly 0
        # there, as in torch; sigmoid would leave 1e-28
        u2 = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)  # 2u
        e = tl.exp(-tl.abs(u2))
        tanh_abs = (1.0 - e) / (1.0 + e)
        tanh_u = tl.where(u2 < 0, -tanh_abs, tanh_abs)
        act = (0.5 * gate * (1.0 + tanh_u)).to(out.dtype.element_ty).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + t * stride_o + offs, (act * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor, *, out: torch.Tensor | None = None, gelu_tanh: bool = False
) -> torch.Tensor:
    """x [T, 2I] (row stride free) -> [T, I] in x's dtype; gelu_tanh: GELU (tanh form) instead
    of SiLU."""
    dev = x.device
    check_tensor("x", x, 2, FLOAT_DTYPES, dev)
    num_tokens, width = x.shape
    check(width % 2 == 0, "x: last dim {} must be even (gate and up halves)", width)
    inter = width // 2
    out = check_out(out, (num_tokens, inter), x)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        INTER=inter,
        BLOCK=block,
        GELU_TANH=gelu_tanh,
        num_warps=4,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """The torch twin: the MLP's expressions (layers.silu_and_mul, layers.gelu_tanh_and_mul)."""
    gate, up = x.chunk(2, dim=-1)
    if gelu_tanh:
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
