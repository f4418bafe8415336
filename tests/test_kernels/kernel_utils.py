"""Helpers of the kernel tests: devices, random inputs, poisoning, error measures."""

from __future__ import annotations

import os
import zlib

import torch

from weft.runtime.kv_pool import quantize_kv
from weft.runtime.models.fp8 import FP8_DTYPE

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# where the tiny-shape tests run: the CPU under the interpreter, else the GPU
SMALL_DEVICE = torch.device("cpu") if INTERPRETED else torch.device("cuda")

# |out - ref| / |ref| (2-norms) against a float64 reference: 16-bit inputs and outputs carry
# ~2e-3 from rounding alone; fp32 lands far under 1e-5
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def generator(name: str, device: torch.device) -> torch.Generator:
    """A generator seeded by `name` (the test id): inputs differ per test and reproduce."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(name.encode()))
    return g


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float32, device=device, generator=g).to(dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A NaN-filled output buffer: an element the kernel does not write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten elements?)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def random_table(
    rows: int,
    cols: int,
    num_entries: int,
    dtype: torch.dtype,
    device: torch.device,
    g: torch.Generator,
) -> torch.Tensor:
    """req_to_token [rows, cols]: distinct random entries in 1 .. num_entries-1 (0 is reserved)."""
    assert rows * cols < num_entries, "not enough distinct entries"
    perm = torch.randperm(num_entries - 1, generator=g, device=device)[: rows * cols] + 1
    return perm.view(rows, cols).to(dtype)


def poison_unused(
    buf: torch.Tensor,
    table: torch.Tensor,
    row_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """NaN into the slots the table maps past each request's length: reading one is a bug.

    NOTE: needs distinct table entries (random_table), so no such slot is another request's.
    """
    cols = table.shape[1]
    pos = torch.arange(cols * page_size, device=table.device)  # every position a row can map
    entries = table[row_ids.long()][:, pos // page_size].long()  # [B, cols * page_size]
    slots = entries * page_size + pos % page_size
    unused = pos[None, :] >= seq_lens.long()[:, None]
    buf[slots[unused]] = float("nan")


def poison_before(
    buf: torch.Tensor,
    table: torch.Tensor,
    row_ids: torch.Tensor,
    starts: torch.Tensor,
    page_size: int,
) -> None:
    """NaN into the slots of positions < starts[b] of each request: keys before every query's
    sliding window, which a kernel must skip, not mask (0 * a NaN value is NaN in p @ V)."""
    cols = table.shape[1]
    pos = torch.arange(cols * page_size, device=table.device)
    entries = table[row_ids.long()][:, pos // page_size].long()  # [B, cols * page_size]
    slots = entries * page_size + pos % page_size
    buf[slots[pos[None, :] < starts.long()[:, None]]] = float("nan")


def assert_rounding_close(
    got: torch.Tensor, ref: torch.Tensor, ulps: int = 2, atol: float = 0.0
) -> None:
    """Elementwise kernels compute what their twin computes (fp32 inside, the same roundings to
    the output dtype); only fp32 rounding differences (rsqrt, FMA contraction, summation order)
    may flip a 16-bit rounding: each element within `ulps` units in the last place (or `atol`,
    for results that cancel: an fp32 difference there is many ulps of a tiny result), few differ.

    NOTE: Triton's interpreter (3.9) truncates fp32 -> bf16 where the GPU rounds to nearest even,
    so under it bf16 results may sit one more ulp per rounding away, and many differ.
    """
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all(), "output has NaN/inf (unwritten elements?)"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=max(atol, 1e-6))
        return
    truncating = INTERPRETED and got.dtype == torch.bfloat16
    if truncating:
        ulps += 2
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[got.dtype]
    g, r = got.double(), ref.double()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - mantissa_bits)
    worst = ((g - r).abs() / ulp).masked_fill((g - r).abs() <= atol, 0).max().item()
    assert worst <= ulps, f"{worst} ulps apart (allowed {ulps})"
    differ = (got != ref).float().mean().item()
    assert truncating or differ < 0.05, f"{differ:.1%} of the elements differ"


def fp8_pool(args: dict, k_scale: float, v_scale: float) -> dict:
    """An attention case with an FP8 pool: its buffers hold K / k_scale and V / v_scale in e4m3."""
    return {
        **args,
        "k_buffer": quantize_kv(args["k_buffer"], k_scale, FP8_DTYPE),
        "v_buffer": quantize_kv(args["v_buffer"], v_scale, FP8_DTYPE),
    }
