"""SiLU-and-mul (and its GELU-tanh variant) vs its torch twin (the MLPs' expressions)."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.activation import silu_and_mul, silu_and_mul_ref
from weft.runtime.models.layers import gelu_tanh_and_mul

from .kernel_utils import SMALL_DEVICE, assert_rounding_close, generator, poisoned, randn


def _run(
    name: str, device: torch.device, dtype: torch.dtype, t: int, inter: int, gelu: bool = False
) -> None:
    g = generator(name, device)
    x = 3 * randn((t, 2 * inter + 6), dtype, device, g)[:, : 2 * inter]  # row stride != 2I
    x[0, :4] = torch.tensor([-60.0, -9.0, 0.0, 9.0], dtype=dtype)  # both tails of the gate
    out = poisoned((t, inter), dtype, device)
    got = silu_and_mul(x, out=out, gelu_tanh=gelu)
    assert got is out
    # NOTE: GELU's left tail is 1 + tanh(u) with tanh near -1: an fp32 ulp of tanh there is
    # many ulps of the tiny result, so those elements are held to an absolute bound
    assert_rounding_close(got, silu_and_mul_ref(x, gelu), atol=1e-5 if gelu else 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [16, 86, 1500])
def test_silu_and_mul(request, dtype, inter):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 3, inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [16, 86])
def test_gelu_tanh_and_mul(request, dtype, inter):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 3, inter, gelu=True)


def test_gelu_twin_is_the_layer():
    x = torch.randn((3, 40), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(gelu_tanh_and_mul(x), silu_and_mul_ref(x, gelu_tanh=True))


def test_silu_and_mul_checks():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.ones((2, 7), device=SMALL_DEVICE))


@pytest.mark.cuda
def test_silu_and_mul_real_shapes_cuda(request):
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, 4096, 14336)


@pytest.mark.cuda
def test_gelu_tanh_and_mul_real_shapes_cuda(request):
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, 4096, 2048, gelu=True)
