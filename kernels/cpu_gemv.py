"""Weight-only int8 / int4 products of a few rows on a CPU (decode): the forms of weft's own C
(csrc/quant_gemv.c, built and called through kernels/cpu_native.py) and their torch twins.

torch's packed int4/int8 CPU kernels stream a decode step's weights at ~10-11 GB/s on 2 cores
that read ~28 GB/s (RESULTS.md, issue 21); these stream them at the memory's rate. Each is the
float32 product of x and the dequantized weight, summed in another order (int4: x widened to
int16 first); `reference_int8` / `reference_int4` are their torch twins.
"""

from __future__ import annotations

import torch

GROUP = 32


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q u8 [N, K] (0..15), scale and zero [N, K/32] with w = (q - 8) * scale + zero -> the C's
    form: u8 [N, K/2] (per group byte i: k = i low, k = i + 16 high) and bf16 [N, K/32, 2] of
    (scale, offset = zero - 8 * scale), the offset rounded once from float32."""
    n, k = q.shape
    groups = q.view(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)
    packed = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2)
    scale32 = scale.float()
    so = torch.stack((scale32, zero.float() - 8 * scale32), dim=-1).to(torch.bfloat16)
    return packed.contiguous(), so.contiguous()


def reference_int4(x: torch.Tensor, packed: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
    """The torch twin of cpu_native.NativeCPU.int4, in float32."""
    n = packed.shape[0]
    nib = packed.view(n, -1, GROUP // 2)
    q = torch.cat((nib & 15, nib >> 4), dim=-1).float()
    w = q * so[..., 0:1].float() + so[..., 1:2].float()
    return x.float() @ w.view(n, -1).t()


def reference_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch twin of cpu_native.NativeCPU.int8, in float32."""
    return x.float() @ (q.float() * scale.float()[:, None]).t()
