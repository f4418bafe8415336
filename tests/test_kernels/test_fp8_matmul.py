"""The FP8 scaled matmul and the FP8 weight-only GEMV vs their float64 torch twins; the FP8
activation quantization vs its torch twin.

Both sides read the same e4m3 values and scales, so the only differences are the fp32
accumulation order and the output rounding: fp32 outputs land under 1e-5 (measured <= 1e-7 on
the interpreter), bfloat16 ones under REL_TOL (the output rounding, ~2e-3).
"""

from __future__ import annotations

import pytest
import torch

from weft.kernels.fp8_matmul import (
    fp8_gemv,
    fp8_gemv_ref,
    fp8_matmul,
    fp8_matmul_ref,
    fp8_rows_matmul,
    rows_tiles,
)
from weft.kernels.fp8_quant import quantize_rows_fp8
from weft.runtime.models.fp8 import quantize_rows, quantize_weight

from .kernel_utils import REL_TOL, SMALL_DEVICE, generator, poisoned, randn, rel_err

BLOCK = (128, 128)


def _weight(name, device, n, k, block, row_stride_pad=0):
    g = generator(name, device)
    w = randn((n, k), torch.float32, device, g)
    q, scale = quantize_weight(w, block)
    if row_stride_pad:  # row stride != K
        wide = torch.zeros(n, k + row_stride_pad, device=device).to(q.dtype)
        wide[:, :k] = q
        q = wide[:, :k]
    group = (1, k) if block is None else block
    return q, scale, group, g


@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (5, 40, 64, None),  # rowwise, ragged M and N
        (3, 144, 256, BLOCK),  # blockwise, a partial block of rows
        (17, 96, 200, BLOCK),  # blockwise, a partial block along K
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_matmul(request, m, n, k, block, out_dtype):
    w, w_scale, group, g = _weight(request.node.nodeid, SMALL_DEVICE, n, k, block)
    x = randn((m, k), torch.float32, SMALL_DEVICE, g) * 3
    xq, x_scale = quantize_rows(x, None if block is None else 128)
    out = poisoned((m, n), out_dtype, SMALL_DEVICE)
    got = fp8_matmul(xq, x_scale, w, w_scale, group, out_dtype=out_dtype, out=out, block_n=32)
    assert got is out
    want = fp8_matmul_ref(xq, x_scale, w, w_scale, group)
    assert rel_err(got, want) < (1e-5 if out_dtype == torch.float32 else REL_TOL[out_dtype])


@pytest.mark.parametrize(
    ("n", "k", "block", "block_k"),
    [
        (13, 64, None, 32),  # rowwise, K over two tiles
        (40, 100, None, 64),  # rowwise, a partial K tile
        (130, 256, BLOCK, 64),  # blockwise: two tiles per scale block, a partial row block
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv(request, n, k, block, block_k, with_bias):
    w, scale, group, g = _weight(request.node.nodeid, SMALL_DEVICE, n, k, block, row_stride_pad=16)
    x = randn((1, k), torch.bfloat16, SMALL_DEVICE, g)
    bias = randn((n,), torch.bfloat16, SMALL_DEVICE, g) if with_bias else None
    out = poisoned((1, n), torch.bfloat16, SMALL_DEVICE)
    got = fp8_gemv(x, w, scale, group, bias, out=out, block_n=8, block_k=block_k)
    assert got is out
    assert rel_err(got, fp8_gemv_ref(x, w, scale, group, bias)) < REL_TOL[torch.bfloat16]


def test_fp8_gemv_default_tiles(request):
    w, scale, group, g = _weight(request.node.nodeid, SMALL_DEVICE, 24, 256, BLOCK)
    x = randn((1, 256), torch.float32, SMALL_DEVICE, g)
    assert rel_err(fp8_gemv(x, w, scale, group), fp8_gemv_ref(x, w, scale, group)) < 1e-5


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "splits"),
    [
        (5, 40, 64, None, None),  # rowwise, ragged M and N, one split
        (3, 144, 256, BLOCK, 2),  # blockwise, a partial block of rows, a scale block per split
        (17, 96, 640, None, 3),  # five K tiles in splits of two: the last split half past K
        (9, 64, 200, BLOCK, 2),  # blockwise, a partial K tile
        (33, 72, 512, BLOCK, None),  # past one 32-row tile; the default splits
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_rows_matmul(request, m, n, k, block, splits, dtype):
    """The weight-only matmul reads x as it is: against the float64 product of the same x and
    the dequantized weight, only the fp32 summation order and the output rounding differ."""
    w, scale, group, g = _weight(request.node.nodeid, SMALL_DEVICE, n, k, block, row_stride_pad=16)
    x = randn((m, k), dtype, SMALL_DEVICE, g)
    got = fp8_rows_matmul(x, w, scale, group, splits=splits)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, fp8_gemv_ref(x, w, scale, group)) < REL_TOL[dtype]


def test_rows_tiles_split_k_to_fill_the_gpu():
    # Llama-3-8B's down projection at 64 rows on 132 SMs: 64 tiles of 64 columns, 4 x 132 / 64
    # -> 9 splits of K's 112 tiles of 128, 13 each (the last 8); gate_up (448 tiles): two
    assert rows_tiles(64, 4096, 14336, 132) == (64, 9, 13 * 128)
    assert rows_tiles(64, 28672, 4096, 132) == (64, 2, 16 * 128)
    assert rows_tiles(8, 4096, 4096, 132) == (16, 8, 4 * 128)  # at most ROWS_MIN_STEPS apart
    assert rows_tiles(64, 4096, 256, 132) == (64, 1, 256)  # too short to split


def test_fp8_checks():
    w, scale = quantize_weight(torch.ones(16, 256, device=SMALL_DEVICE), BLOCK)
    x = torch.ones(2, 256, device=SMALL_DEVICE)
    xq, xs = quantize_rows(x, 128)
    with pytest.raises(ValueError, match="xq: dtype"):
        fp8_matmul(x, xs, w, scale, BLOCK)
    with pytest.raises(ValueError, match="x_scale: expected shape"):
        fp8_matmul(xq, xs[:, :1], w, scale, BLOCK)
    with pytest.raises(ValueError, match="groups of 128 columns"):
        fp8_matmul(xq, xs, w, scale, (128, 64))
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(x, w, scale, BLOCK)
    with pytest.raises(ValueError, match="must divide the scale group"):
        fp8_gemv(x[:1], w, scale, BLOCK, block_k=256)
    with pytest.raises(ValueError, match="x: dtype"):
        fp8_rows_matmul(x, w, scale, BLOCK)  # float32 activations
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_rows_matmul(x.bfloat16(), w, scale, (128, 64))


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("block", [None, BLOCK])
def test_fp8_real_shapes_cuda(request, n, k, block):
    device = torch.device("cuda")
    w, scale, group, g = _weight(request.node.nodeid, device, n, k, block)
    x = randn((1, k), torch.bfloat16, device, g)
    assert rel_err(fp8_gemv(x, w, scale, group), fp8_gemv_ref(x, w, scale, group)) < 1e-2
    xs = randn((64, k), torch.bfloat16, device, g)
    xq, x_scale = quantize_rows(xs, None if block is None else 128)
    got = fp8_matmul(xq, x_scale, w, scale, group)
    assert rel_err(got, fp8_matmul_ref(xq, x_scale, w, scale, group)) < 1e-2
    for m in (2, 16, 64):
        got = fp8_rows_matmul(xs[:m], w, scale, group)
        assert rel_err(got, fp8_gemv_ref(xs[:m], w, scale, group)) < 1e-2


# -- the activation quantization kernel ----------------------------------------------------------


@pytest.mark.parametrize(("m", "k", "group"), [(3, 200, 128), (5, 64, None), (2, 1300, None)])
def test_quantize_rows_fp8_exact(request, m, k, group):
    """Inputs whose quantized values are exact: e4m3 values times 2^-3, each group's amax 448 *
    2^-3, so every scale is 2^-3 and x / scale an e4m3 value. (NOTE: Triton 3.9's interpreter
    rounds fp32 -> e4m3 wrongly where a value rounds up into the next binade: 124.3 -> 64, not
    128; random inputs are compared on CUDA only, below.)"""
    g = generator(request.node.nodeid, SMALL_DEVICE)
    q0 = randn((m, k), torch.float32, SMALL_DEVICE, g).mul(40).clamp(-448, 448)
    q0 = q0.to(torch.float8_e4m3fn).float()
    span = k if group is None else group
    q0[:, ::span] = 448.0  # each group's amax
    q0[0] = 0.0  # a row of zeros: a nonzero scale, zeros out
    x = (q0 * 2.0**-3).to(torch.bfloat16)
    q, scale = quantize_rows_fp8(x, group)
    ref_q, ref_scale = quantize_rows(x, group)
    assert torch.equal(scale, ref_scale) and torch.equal(q.float(), ref_q.float())
    assert torch.equal(q[1:].float(), q0[1:])


@pytest.mark.cuda
@pytest.mark.parametrize("group", [None, 128])
def test_quantize_rows_fp8_random_cuda(request, group):
    device = torch.device("cuda")
    g = generator(request.node.nodeid, device)
    x = randn((300, 4096), torch.bfloat16, device, g) * 5
    q, scale = quantize_rows_fp8(x, group)
    ref_q, ref_scale = quantize_rows(x, group)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    # the kernel's fp32 division may differ from torch's in the last bit: a value on a rounding
    # tie can land one e4m3 step away, never more
    diff = (q.float() - ref_q.float()).abs()
    assert float((diff > 0).float().mean()) < 1e-3
    assert bool((diff <= ref_q.float().abs() * 2.0**-3 + 2.0**-9).all())
