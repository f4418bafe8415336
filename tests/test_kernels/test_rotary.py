"""Rotate-half RoPE vs its torch twin (layers.Rotary), plain and Llama-3.1-scaled tables."""

from __future__ import annotations

import pytest
import torch

from weft.kernels.rotary import apply_rotary, apply_rotary_ref
from weft.runtime.models.layers import Rotary

from .kernel_utils import SMALL_DEVICE, assert_rounding_close, generator, poisoned, randn

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _tables(d: int, max_pos: int, scaling: dict | None, device: torch.device):
    rot = Rotary(d, max_pos, 500000.0 if scaling else 10000.0, scaling)
    return rot.cos.to(device), rot.sin.to(device), rot


def _run(name, device, dtype, t, hq, hkv, d, scaling, max_pos, in_place):
    g = generator(name, device)
    cos, sin, _ = _tables(d, max_pos, scaling, device)
    # q and k as the model holds them: one [T, Hq + Hkv, D] view of a fused qkv output
    qkv = randn((t, (hq + 2 * hkv) * d), dtype, device, g)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    positions = torch.randint(0, max_pos, (t,), generator=g, device=device)
    ref = apply_rotary_ref(qk, cos, sin, positions)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    if in_place:
        got = apply_rotary(qk, cos, sin, positions, out=qk)
        assert got is qk
        assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    else:
        before = qk.clone()
        out = poisoned((t, hq + hkv, d), dtype, device)
        got = apply_rotary(qk, cos, sin, positions, out=out)
        assert torch.equal(qk, before)
    # x1 * cos - x2 * sin cancels at some angles, where the GPU's fused multiply-add differs
    # from torch's two roundings by ~1e-7 * |x|: many ulps of a tiny result
    assert_rounding_close(got, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA31], ids=["plain", "llama31"])
@pytest.mark.parametrize("in_place", [False, True])
def test_rotary(request, dtype, scaling, in_place):
    _run(request.node.nodeid, SMALL_DEVICE, dtype, 6, 4, 2, 32, scaling, 20000, in_place)


@pytest.mark.parametrize("d", [8, 24, 128])
def test_rotary_head_dims(request, d):
    _run(request.node.nodeid, SMALL_DEVICE, torch.float32, 3, 3, 1, d, None, 64, False)


def test_rotary_twin_is_the_layer(request):
    g = generator(request.node.nodeid, torch.device("cpu"))
    cos, sin, rot = _tables(64, 1000, LLAMA31, torch.device("cpu"))
    x = randn((5, 3, 64), torch.bfloat16, torch.device("cpu"), g)
    pos = torch.tensor([0, 7, 999, 3, 500])
    assert torch.equal(rot.rotate(x, rot.lookup(pos)), apply_rotary_ref(x, cos, sin, pos))


@pytest.mark.cuda
@pytest.mark.parametrize("in_place", [False, True])
def test_rotary_real_shapes_cuda(request, in_place):
    _run(
        request.node.nodeid,
        torch.device("cuda"),
        torch.bfloat16,
        4096,
        32,
        8,
        128,
        LLAMA31,
        131072,
        in_place,
    )
