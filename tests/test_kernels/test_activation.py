"""SiLU-and-mul vs its torch twin (the MLP's expression)."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.activation import silu_and_mul, silu_and_mul_ref

from .kernel_utils import SMALL_DEVICE, assert_rounding_close, generator, poisoned, randn


def _run(name: str, device: torch.device, dtype: torch.dtype, t: int, inter: int) -> None:
    g = generator(name, device)
    x = 3 * randn((t, 2 * inter + 6), dtype, device, g)[:, : 2 * inter]  # row stride != 2I
    out = poisoned((t, inter), dtype, device)
    got = silu_and_mul(x, out=out)
    assert got is out
    assert_rounding_close(got, silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [16, 86, 1500])
def test_silu_and_mul(request, dtype, inter):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 3, inter)


def test_silu_and_mul_checks():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.ones((2, 7), device=SMALL_DEVICE))


@pytest.mark.cuda
def test_silu_and_mul_real_shapes_cuda(request):
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, 4096, 14336)
