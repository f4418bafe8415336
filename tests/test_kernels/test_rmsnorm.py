"""Fused RMSNorm vs its torch twin (layers.RMSNorm's operations, and GemmaRMSNorm's with
unit_offset), with and without residual."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from weft.runtime.models.layers import GemmaRMSNorm, RMSNorm

from .kernel_utils import SMALL_DEVICE, assert_rounding_close, generator, poisoned, randn


def _run(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    t: int,
    h: int,
    res: bool,
    unit_offset: bool = False,
) -> None:
    g = generator(name, device)
    wide = randn((t, h + 8), dtype, device, g)
    x = wide[:, :h]  # row stride != h
    residual = randn((t, h), dtype, device, g) if res else None
    weight = (1 + 0.1 * randn((h,), torch.float32, device, g)).to(dtype)
    eps = 1e-5
    out = poisoned((t, h), dtype, device)
    res_out = poisoned((t, h), dtype, device) if res else None
    if unit_offset:
        weight = weight - 1  # Gemma's checkpoints store the scale minus one
    got, got_sum = rmsnorm(
        x, weight, eps, residual, out=out, residual_out=res_out, unit_offset=unit_offset
    )
    ref, ref_sum = rmsnorm_ref(x, weight, eps, residual, unit_offset)
    assert got is out
    assert_rounding_close(got, ref)
    assert_rounding_close(got_sum, ref_sum, ulps=0)  # the residual stream: one rounding, exact
    if not res:
        assert got_sum is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("h", [64, 100])
def test_rmsnorm(request, dtype, res, h):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 5, h, res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("res", [False, True])
def test_rmsnorm_unit_offset(request, dtype, res):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 5, 100, res, unit_offset=True)


def test_gemma_twin_is_the_layer(request):
    g = generator(request.node.nodeid, torch.device("cpu"))
    layer = GemmaRMSNorm(48, 1e-6, torch.bfloat16)
    layer.weight.data = randn((48,), torch.bfloat16, torch.device("cpu"), g)
    x = randn((3, 48), torch.bfloat16, torch.device("cpu"), g)
    r = randn((3, 48), torch.bfloat16, torch.device("cpu"), g)
    ref = rmsnorm_ref(x, layer.weight.data, 1e-6, r, unit_offset=True)
    for a, b in zip(layer(x, r), ref, strict=True):
        assert torch.equal(a, b)


def test_rmsnorm_twin_is_the_layer(request):
    """The reference twin computes what the model's RMSNorm layer computes."""
    g = generator(request.node.nodeid, torch.device("cpu"))
    layer = RMSNorm(48, 1e-6, torch.bfloat16)
    layer.weight.data = randn((48,), torch.bfloat16, torch.device("cpu"), g)
    x = randn((3, 48), torch.bfloat16, torch.device("cpu"), g)
    r = randn((3, 48), torch.bfloat16, torch.device("cpu"), g)
    for a, b in zip(layer(x, r), rmsnorm_ref(x, layer.weight.data, 1e-6, r), strict=True):
        assert torch.equal(a, b)


def test_rmsnorm_in_place(request):
    g = generator(request.node.nodeid, SMALL_DEVICE)
    x = randn((4, 32), torch.float32, SMALL_DEVICE, g)
    r = randn((4, 32), torch.float32, SMALL_DEVICE, g)
    w = randn((32,), torch.float32, SMALL_DEVICE, g)
    ref, ref_sum = rmsnorm_ref(x, w, 1e-5, r)
    got, got_sum = rmsnorm(x, w, 1e-5, r, out=x, residual_out=r)
    assert got is x and got_sum is r
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
    assert torch.equal(got_sum, ref_sum)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_real_shapes_cuda(request, dtype):
    _run(request.node.nodeid, torch.device("cuda"), dtype, 4096, 4096, True)


@pytest.mark.cuda
def test_rmsnorm_unit_offset_real_shapes_cuda(request):
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, 4096, 640, True, True)
