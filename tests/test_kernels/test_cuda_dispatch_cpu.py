"""The kernel dispatch decided on CUDA only, run on the CPU: `linear`'s choice of the GEMV
kernel (decided on fake CUDA tensors, then the kernel run on the CPU copies under Triton's
interpreter), the decode split count sized from the GPU's SMs, the dot precision on CUDA, and
TritonAttention's step bookkeeping (the mixed-step ablation, the aligned copies of the rest)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import weft.kernels.gemv as gemv_module
import weft.runtime.models.layers as layers
from weft.kernels._checks import dot_mode
from weft.kernels.decode_attention import default_num_kv_splits
from weft.runtime.attention import TorchAttention
from weft.runtime.triton_attention import TritonAttention

from .kernel_utils import SMALL_DEVICE, rel_err
from .test_triton_attention import NUM_LAYERS, _setup

CUDA = torch.device("cuda")
Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _ints(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """Small integers as float32: every product and sum below is exact, in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float().to(device)


# name: (operands on a device, what `linear` runs on CUDA with Triton)
CASES: dict[str, tuple[Callable[[torch.device], Operands], str]] = {
    "row": (lambda d: (_ints((1, 24), d, 1), _ints((40, 24), d, 2), None), "gemv"),
    "row+bias": (
        lambda d: (_ints((1, 24), d, 1), _ints((40, 24), d, 2), _ints((40,), d, 3)),
        "gemv",
    ),
    # the last token's hidden state of a step (decode sampling): a view at an offset
    "last row of a step": (
        lambda d: (_ints((3, 24), d, 4)[2:], _ints((40, 24), d, 2), None),
        "gemv",
    ),
    # a column block of a wider weight: a row stride past its row length
    "columns of a wider weight": (
        lambda d: (_ints((1, 24), d, 1), _ints((40, 48), d, 5)[:, 8:32], None),
        "gemv",
    ),
    "two rows": (lambda d: (_ints((2, 24), d, 1), _ints((40, 24), d, 2), None), "linear"),
    "strided x": (lambda d: (_ints((1, 48), d, 6)[:, ::2], _ints((40, 24), d, 2), None), "linear"),
    "transposed weight": (
        lambda d: (_ints((1, 24), d, 1), _ints((24, 40), d, 7).T, None),
        "linear",
    ),
}


def _cuda_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which path `linear` takes for operands of these shapes and strides on CUDA: decided on fake
    CUDA tensors of the same layout, with the GEMV kernel replaced by a recorder."""
    calls: list[Operands] = []

    def fake_gemv(x, weight, bias=None):
        calls.append((x, weight, bias))
        return torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)

    real = gemv_module.gemv
    gemv_module.gemv = fake_gemv
    try:
        with FakeTensorMode():
            # NOTE: slicing a fake CUDA tensor needs a CUDA build; empty_strided does not
            fx, fw, fb = (
                None if t is None else torch.empty_strided(t.shape, t.stride(), device=CUDA)
                for t in (x, weight, bias)
            )
            assert fx is not None and fw is not None and fx.is_cuda
            out = layers.linear(fx, fw, fb)
            assert out.shape == (x.shape[0], weight.shape[0])
    finally:
        gemv_module.gemv = real
    if not calls:
        return "linear"
    assert calls == [(fx, fw, fb)]  # the operands themselves, no copies
    return "gemv"


@pytest.mark.parametrize("name", list(CASES))
def test_linear_dispatch(name):
    """On CUDA a single row with unit last strides takes the GEMV kernel, which then agrees with
    F.linear on those very operands; on the CPU every single row takes torch.mv."""
    make, want = CASES[name]
    x, weight, bias = make(torch.device("cpu"))
    assert _cuda_choice(x, weight, bias) == want
    expected = F.linear(x, weight, bias)
    assert torch.equal(layers.linear(x, weight, bias), expected)  # torch.mv for one row
    if want == "gemv":  # the operands the dispatch hands the kernel are ones it accepts
        x, weight, bias = make(SMALL_DEVICE)
        assert torch.equal(gemv_module.gemv(x, weight, bias).cpu(), expected)


def test_linear_without_triton_never_takes_the_kernel(monkeypatch):
    monkeypatch.setattr(layers, "HAS_TRITON", False)
    assert _cuda_choice(*CASES["row"][0](torch.device("cpu"))) == "linear"


def test_decode_splits_from_the_gpu_sm_count(monkeypatch):
    """4 programs per SM over (request, KV head, split), each split >= 256 positions, <= 64."""
    asked = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(multi_processor_count=132)  # an H100 SXM

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    # B=1, Hkv=8: ceil(528 / 8) = 66 programs wanted, ceil(4096 / 256) = 16 splits possible
    assert default_num_kv_splits(1, 8, 4096, CUDA) == 16
    assert default_num_kv_splits(1, 8, 32768, CUDA) == 64  # min(66, 128, 64)
    assert default_num_kv_splits(1, 1, 100_000, CUDA) == 64
    assert default_num_kv_splits(8, 8, 32768, CUDA) == 9  # ceil(528 / 64)
    assert default_num_kv_splits(64, 8, 4096, CUDA) == 2  # ceil(528 / 512)
    assert default_num_kv_splits(256, 8, 4096, CUDA) == 1
    assert default_num_kv_splits(4, 2, 0, CUDA) == 1  # an empty context: one split
    assert asked == [CUDA] * 7
    # on the CPU: 4 "SMs", no CUDA call
    assert default_num_kv_splits(1, 1, 4096, torch.device("cpu")) == 16
    assert default_num_kv_splits(2, 2, 4096, torch.device("cpu")) == 4
    assert len(asked) == 7


def test_dot_precision_by_device():
    """CUDA: fp32 products for fp32 tensors, tf32 (native 16-bit) otherwise, no upcast; CPU
    tensors (the interpreter) upcast 16-bit operands."""
    assert dot_mode(torch.float32, CUDA) == (False, "ieee")
    assert dot_mode(torch.bfloat16, CUDA) == (False, "tf32")
    assert dot_mode(torch.float16, CUDA) == (False, "tf32")
    assert dot_mode(torch.bfloat16, torch.device("cpu")) == (True, "tf32")
    assert dot_mode(torch.float32, torch.device("cpu")) == (True, "ieee")


@pytest.mark.parametrize("num_decode", [1, 2, 3])
def test_rest_of_a_mixed_step_is_16_byte_aligned(request, num_decode):
    """The extend kernel's per-request fields start 16-byte aligned whatever the count of leading
    decodes (views at odd int64 offsets compiled the kernel anew mid-serving), and hold the
    rest's values."""
    prefix, ext = [5] * num_decode + [3, 0], [1] * num_decode + [4, 6]
    pool, table, batch, _ = _setup(
        request.node.nodeid, SMALL_DEVICE, torch.float32, prefix, ext, 2, 1, 8
    )
    attn = TritonAttention(pool, table)
    attn.prepare(batch)
    assert attn._num_decode == num_decode
    assert attn._rest_rows.tolist() == batch.req_pool_indices[num_decode:].tolist()
    assert attn._rest_prefix_lens.tolist() == [3, 0]
    assert attn._qo_indptr.tolist() == [0, 4, 10]
    assert attn._max_extend_len == 6
    for t in (attn._rest_rows, attn._rest_prefix_lens, attn._qo_indptr):
        assert t.data_ptr() % 16 == 0


def test_mixed_step_without_the_split_matches_torch(request):
    """split_mixed off (the ablation): a mixed step runs the extend kernel over every request,
    with the same outputs; a pure decode step still takes the decode kernel."""
    prefix, ext = [30, 8, 0, 12], [1, 1, 14, 1]
    pool, table, batch, g = _setup(
        request.node.nodeid, SMALL_DEVICE, torch.float32, prefix, ext, 4, 2, 16
    )
    reference, triton = TorchAttention(pool, table), TritonAttention(pool, table)
    triton.split_mixed = False
    reference.prepare(batch)
    triton.prepare(batch)
    assert triton._num_decode == 0 and triton._qo_indptr.tolist() == [0, 1, 2, 16, 17]
    for layer in range(NUM_LAYERS):
        q = torch.randn((batch.num_tokens, 4, 16), generator=g, device=SMALL_DEVICE)
        k = torch.randn((batch.num_tokens, 2, 16), generator=g, device=SMALL_DEVICE)
        v = torch.randn((batch.num_tokens, 2, 16), generator=g, device=SMALL_DEVICE)
        got = triton.forward(q, k, v, layer, batch)
        want = reference.forward(q, k, v, layer, batch)
        assert rel_err(got, want) < 1e-5
    decode_prefix, decode_ext = [7, 2], [1, 1]
    pool, table, batch, _ = _setup(
        request.node.nodeid, SMALL_DEVICE, torch.float32, decode_prefix, decode_ext, 4, 2, 16
    )
    triton = TritonAttention(pool, table)
    triton.split_mixed = False
    triton.prepare(batch)
    assert triton._num_decode == 2
