"""kv_store vs its torch twin: exactly the given slots change, bit for bit (into an FP8 pool:
the scaled, saturated e4m3 values)."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.kv_store import kv_store, kv_store_ref
from weft.runtime.models.fp8 import FP8_DTYPE, FP8_MAX

from .kernel_utils import INTERPRETED, SMALL_DEVICE, generator, randn


def _run(name: str, device: torch.device, dtype: torch.dtype, t: int, hkv: int, d: int) -> None:
    g = generator(name, device)
    num_slots = 3 * t + 5
    # k and v as views of a fused qkv output [T, (Hq + 2 Hkv) * D] (token stride != Hkv * D)
    qkv = randn((t, (2 + 2 * hkv) * d), dtype, device, g)
    k = qkv[:, 2 * d : (2 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (2 + hkv) * d :].view(t, hkv, d)
    loc = (torch.randperm(num_slots - 1, generator=g, device=device)[:t] + 1).to(torch.int64)
    # NaN-poisoned buffers: the written slots must hold k/v, every other slot stays NaN
    k_buf = torch.full((num_slots, hkv, d), float("nan"), dtype=dtype, device=device)
    v_buf = k_buf.clone()
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    kv_store(k, v, k_buf, v_buf, loc)
    kv_store_ref(k, v, k_ref, v_ref, loc)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    torch.testing.assert_close(k_buf, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_buf, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hkv", "d"), [(2, 16), (3, 8), (1, 64)])
def test_kv_store(request, dtype, hkv, d):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 7, hkv, d)


def test_kv_store_int32_locs_and_checks(request):
    dev = SMALL_DEVICE
    g = generator(request.node.nodeid, dev)
    k = randn((4, 2, 16), torch.float32, dev, g)
    buf = torch.zeros((9, 2, 16), device=dev)
    vbuf = torch.zeros_like(buf)
    kv_store(k, k, buf, vbuf, torch.tensor([3, 1, 8, 5], dtype=torch.int32, device=dev))
    assert torch.equal(buf[[3, 1, 8, 5]], k) and torch.equal(vbuf[[3, 1, 8, 5]], k)
    assert buf[[0, 2, 4, 6, 7]].eq(0).all()
    with pytest.raises(ValueError, match="out_cache_loc"):
        kv_store(k, k, buf, vbuf, torch.tensor([1, 2], device=dev))
    with pytest.raises(ValueError, match="k_buffer"):
        kv_store(k, k, buf[:, :1], vbuf[:, :1], torch.tensor([1, 2, 3, 4], device=dev))


def _run_fp8(name: str, device: torch.device, t: int, hkv: int, d: int) -> None:
    g = generator(name, device)
    num_slots = 3 * t + 5
    k = randn((t, hkv, d), torch.bfloat16, device, g) * 100  # past 448 * k_scale: saturates
    v = randn((t, hkv, d), torch.bfloat16, device, g)
    loc = (torch.randperm(num_slots - 1, generator=g, device=device)[:t] + 1).to(torch.int64)
    k_buf = torch.full((num_slots, hkv, d), float("nan"), device=device).to(FP8_DTYPE)
    v_buf = k_buf.clone()
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    kv_store(k, v, k_buf, v_buf, loc, k_scale=0.5, v_scale=0.01)
    kv_store_ref(k, v, k_ref, v_ref, loc, k_scale=0.5, v_scale=0.01)
    for got, want in ((k_buf.float(), k_ref.float()), (v_buf.float(), v_ref.float())):
        if INTERPRETED:
            # NOTE: Triton's interpreter (3.x) rounds e4m3 ties away from zero (one step off) and
            # drops the carry of a mantissa that rounds up to the next power of two (127.8 -> 64);
            # GPUs convert with cvt.rn.satfinite, exactly as torch
            off = (got != want) & ~(got.isnan() & want.isnan())
            a, b = got[off], want[off]
            assert (((a - b).abs() <= b.abs() / 8) | (a * 2 == b)).all(), (a, b)
            got = torch.where(off, want, got)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    stored = k_ref[loc].float()  # the kernel matches it (above)
    assert stored.abs().max() == FP8_MAX and not stored.isnan().any()
    expect = (k.float() / 0.5).clamp(-FP8_MAX, FP8_MAX)
    assert ((stored - expect).abs() <= expect.abs() / 16 + 2**-9).all()  # e4m3: 3 mantissa bits


def test_kv_store_fp8(request):
    _run_fp8(request.node.nodeid, SMALL_DEVICE, 7, 2, 16)


@pytest.mark.cuda
def test_kv_store_fp8_real_shapes_cuda(request):
    _run_fp8(request.node.nodeid, torch.device("cuda"), 4096, 8, 128)


@pytest.mark.cuda
def test_kv_store_real_shapes_cuda(request):
    """A 4096-token prefill of Llama-3-8B (Hkv=8, D=128, bf16) into a 1M-slot layer."""
    _run(request.node.nodeid, torch.device("cuda"), torch.bfloat16, 4096, 8, 128)
