"""SiLU-and-mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], rounded like the torch expression
`F.silu(gate) * up` in x's dtype (silu rounded to the dtype, then the product).

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
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + t * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + t * stride_o + offs, (act * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (row stride free) -> [T, I] in x's dtype."""
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
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch twin: the MLP's expression in runtime/models/llama.py."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
