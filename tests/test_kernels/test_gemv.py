"""The batch-1 GEMV kernel vs its torch twin in float64."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.gemv import gemv, gemv_ref

from .kernel_utils import REL_TOL, SMALL_DEVICE, generator, poisoned, randn, rel_err


def _run(name, device, dtype, n, k, with_bias, **tiles):
    g = generator(name, device)
    x = randn((1, k), dtype, device, g)
    weight = randn((n, k + 5), dtype, device, g)[:, :k]  # row stride != K
    bias = randn((n,), dtype, device, g) if with_bias else None
    out = poisoned((1, n), dtype, device)
    got = gemv(x, weight, bias, out=out, **tiles)
    assert got is out
    want = gemv_ref(x.double(), weight.double(), bias.double() if with_bias else None)
    assert rel_err(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(13, 64), (40, 100), (7, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(request, dtype, n, k, with_bias):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, n, k, with_bias, block_n=4, block_k=32)


def test_gemv_default_tiles(request):
    _run(request.node.nodeid, SMALL_DEVICE, torch.float32, 24, 96, True)


def test_gemv_checks():
    w = torch.ones((4, 8), device=SMALL_DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.ones((2, 8), device=SMALL_DEVICE), w)
    with pytest.raises(ValueError, match="x: expected shape"):
        gemv(torch.ones((1, 9), device=SMALL_DEVICE), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(torch.ones((1, 8), device=SMALL_DEVICE, dtype=torch.bfloat16), w)


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gemv_real_shapes_cuda(request, n, k):
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, n, k, False)
