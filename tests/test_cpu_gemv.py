"""weft's CPU kernels for quantized products (kernels/cpu_gemv.py, csrc/quant_gemv.c for output
tokens, csrc/quant_gemm.c for prompts) against their torch twins, in each vector path this CPU
can run (AVX-512, AVX2), on shapes with every remainder the C handles: rows not a multiple of the
row block or panel, K not a multiple of the vector width or the panel's columns, an odd number of
int4 groups, rows of x not a multiple of a tile's, and a row's bits alike in any product."""

from __future__ import annotations

import shutil

import pytest
import torch

from weft.kernels import cpu_gemv, cpu_native
from weft.runtime.hardware import cpu_flags

HAS_AVX2 = {"avx2", "fma"} <= cpu_flags()
pytestmark = pytest.mark.skipif(
    not HAS_AVX2 or (shutil.which("cc") is None and shutil.which("gcc") is None),
    reason="weft's CPU kernels need AVX2 + FMA and a C compiler",
)
# (N, K): N % 4 and K % 16 remainders (int8), an odd count of int4 groups (K / 32 = 3, 5), the
# default model's shapes
INT8_SHAPES = [(64, 128), (37, 200), (5, 24), (1152, 896)]
INT4_SHAPES = [(64, 128), (34, 96), (16, 160), (896, 4864)]


def _paths() -> list[tuple[str, ...]]:
    """The C builds to check: AVX2 everywhere it runs, plus AVX-512 where the CPU has it."""
    paths = [("-mno-avx512f",)]
    if "avx512bw" in cpu_flags():
        paths.append(())
    return paths


@pytest.fixture(scope="module", params=_paths(), ids=lambda flags: "avx2" if flags else "native")
def gemv(request) -> cpu_native.NativeCPU:
    lib = cpu_native.build(request.param)
    assert lib.lanes == (8 if request.param else 16)
    return lib


def _int4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 20
    zero = torch.randn(n, k // 32, generator=g) / 10
    return (q, scale, zero)


@pytest.mark.parametrize(("n", "k"), INT8_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 11])
def test_int8_matches_its_twin(gemv, n, k, m):
    g = torch.Generator().manual_seed(n * k + m)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) / 50).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = gemv.int8(x, q, scale)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    expected = cpu_gemv.reference_int8(x, q, scale)
    _assert_within_x16_rounding(got, expected, q.float() * scale.float()[:, None], x)


@pytest.mark.parametrize(("n", "k"), INT4_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 11])
def test_int4_matches_its_twin(gemv, n, k, m):
    packed, so = cpu_gemv.pack_int4(*_int4_weight(n, k, seed=n + k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = gemv.int4(x, packed, so)
    expected = cpu_gemv.reference_int4(x, packed, so)
    w = cpu_gemv.reference_int4(torch.eye(k), packed, so).t()  # the dequantized weight [N, K]
    _assert_within_x16_rounding(got, expected, w, x)


# quant_gemm.c: panels of 64 rows of w and 64 columns, tiles of 6 rows of x and 16 (AVX2) or 32
# rows of w
GEMM_SHAPES = [(37, 200, "int8"), (5, 24, "int8"), (70, 384, "int4"), (34, 96, "int4")]


@pytest.mark.parametrize(("n", "k", "form"), GEMM_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 6, 13])
def test_prompt_products_match_their_twin(gemv, n, k, form, m):
    """The float32 product (x not rounded to int16): within the float32 sums' order and one
    bf16 rounding of the output."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(torch.bfloat16)
    if form == "int8":
        g = torch.Generator().manual_seed(n * k)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scale = (torch.rand(n, generator=g) / 50).to(torch.bfloat16)
        got = gemv.prompt_int8(x, q, scale)
        expected = cpu_gemv.reference_int8(x, q, scale)
        w = q.float() * scale.float()[:, None]
    else:
        packed, so = cpu_gemv.pack_int4(*_int4_weight(n, k, seed=n + k))
        got = gemv.prompt_int4(x, packed, so)
        expected = cpu_gemv.reference_int4(x, packed, so)
        w = cpu_gemv.reference_int4(torch.eye(k), packed, so).t()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    sums = (x.float().abs() @ w.abs().t()) * k * 2**-23
    err = (got.float() - expected).abs()
    assert bool((err <= sums + expected.abs() * 2**-8 + 1e-6).all()), float(err.max())


def test_a_row_gets_the_same_bits_in_any_product(gemv):
    """Each kernel gives a row of x the bits it gets alone, wherever it sits among how many rows
    (tiles, row groups and blocks of rows split apart), on any thread count: what lets decode
    steps of any batch and prompts in any chunks compute alike."""
    g = torch.Generator().manual_seed(11)
    q8 = torch.randint(-127, 128, (40, 136), dtype=torch.int8, generator=g)
    scale = (torch.rand(40, generator=g) / 50).to(torch.bfloat16)
    packed, so = cpu_gemv.pack_int4(*_int4_weight(36, 160, seed=2))
    # > a call's rows (cpu_native.CALL_ROWS: 1024); quant_gemm.c's 1536-row blocks are never
    # crossed through Python (a call holds at most 1024 rows)
    x8 = torch.randn(1600, 136, generator=g).to(torch.bfloat16)
    x4 = torch.randn(1600, 160, generator=g).to(torch.bfloat16)
    products = [
        (gemv.int8, x8, q8, scale),
        (gemv.int4, x4, packed, so),
        (gemv.prompt_int8, x8, q8, scale),
        (gemv.prompt_int4, x4, packed, so),
    ]
    before = torch.get_num_threads()
    try:
        for run, x, w, s in products:
            whole = run(x, w, s)
            torch.set_num_threads(1)
            for lo, hi in ((0, 1), (1597, 1600), (3, 20), (100, 107), (1530, 1545)):
                assert torch.equal(run(x[lo:hi], w, s), whole[lo:hi]), (run.__name__, lo, hi)
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)


def _assert_within_x16_rounding(
    got: torch.Tensor, expected: torch.Tensor, w: torch.Tensor, x: torch.Tensor
) -> None:
    """got within what the kernels round: x widened to int16 (max |x| / 65534 an element, at
    most), float32 sums in another order, and one bf16 rounding of the output (2^-8 relative)."""
    bound = w.abs().sum(1) * x.float().abs().amax(1, keepdim=True) / 65534
    err = (got.float() - expected).abs()
    assert bool((err <= bound + expected.abs() * 2**-8 + 1e-6).all()), float(err.max())


def test_pack_int4_keeps_the_weight():
    """The C's packing holds w = q * scale + (zero - 8 * scale), with scale and offset each
    rounded once to bf16 (half an ulp: at most 2^-8 relative)."""
    q, scale, zero = _int4_weight(48, 96, seed=3)
    packed, so = cpu_gemv.pack_int4(q, scale, zero)
    w = cpu_gemv.reference_int4(torch.eye(96), packed, so).t()
    scale, zero = scale.repeat_interleave(32, 1), zero.repeat_interleave(32, 1)
    expected = (q.float() - 8) * scale + zero
    rounding = (q.float() * scale + (zero - 8 * scale).abs()) * 2**-8
    assert bool(((w - expected).abs() <= rounding * 1.001).all())
    assert bool((packed.view(48, 3, 16) & 15).eq(q.view(48, 3, 32)[..., :16]).all())


def test_threads_give_the_same_bits(gemv):
    """Each output row is summed by one thread in one order: the thread count changes nothing."""
    packed, so = cpu_gemv.pack_int4(*_int4_weight(256, 512, seed=5))
    q8 = torch.randint(-127, 128, (256, 512), dtype=torch.int8)
    scale = torch.rand(256).to(torch.bfloat16)
    x = torch.randn(3, 512).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append((gemv.int4(x, packed, so), gemv.int8(x, q8, scale)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_failing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match=r"false could not build weft.s CPU kernels"):
        cpu_native.build(("-DWEFT_TEST_FAILING_BUILD",))
    assert not list((tmp_path / "kernels").glob("*.so*"))  # nothing half-written is left


def test_this_cpu_gets_them():
    """Where the C compiler and AVX2 are (CI's machines), the kernels build and the default
    path takes them: a test that fails when they silently stop being used."""
    assert cpu_native.why_not() is None
    native = cpu_native.native()
    assert native is not None and native.lanes in (8, 16)
