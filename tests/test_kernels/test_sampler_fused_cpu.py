"""The sampler's fused path (taken on CUDA only) on the CPU: which logits take it, the parameter
table it builds for the kernel (per-row values, 16-byte aligned), and its tokens: those of the
torch twin, the path CPU logits take, with the same uniforms. On the CPU the kernel runs under
Triton's interpreter; on a GPU machine the same tests run it compiled."""

from __future__ import annotations

import functools

import pytest
import torch

import weft.runtime.sampler as sampler
from weft.kernels.masked_sample import HAS_TRITON, masked_sample
from weft.kernels.masked_sample_ref import masked_sample_reference
from weft.runtime.core import Req
from weft.runtime.sampling_params import SamplingParams

from .kernel_utils import SMALL_DEVICE

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
VOCAB = 80  # 3 bitmask words, the last one partly past the vocabulary

# (temperature, top_k, top_p, min_p, seed): greedy rows draw no uniform
ROWS = [
    (0.0, -1, 1.0, 0.0, None),
    (0.7, 5, 1.0, 0.0, 1),
    (1.0, -1, 0.8, 0.0, 2),
    (1.3, 1, 1.0, 0.0, None),  # top_k 1: greedy
    (0.9, 12, 0.6, 0.05, 3),
]


def _reqs(
    rows: list[tuple[float, int, float, float, int | None]], device: str | None = None
) -> list[Req]:
    reqs = []
    for i, (temperature, top_k, top_p, min_p, seed) in enumerate(rows):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        req = Req(f"r{i}", [1, 2, 3], params)
        if seed is not None:
            req.generator = torch.Generator(device=device or SMALL_DEVICE).manual_seed(seed)
        reqs.append(req)
    return reqs


def _uniforms(rows: list[tuple[float, int, float, float, int | None]]) -> list[float]:
    """The uniform each row's kernel call gets: 0 for greedy rows, else the first draw of a
    generator seeded as the request's."""
    out = []
    for temperature, top_k, _, _, seed in rows:
        if temperature < 1e-5 or top_k == 1:
            out.append(0.0)
        else:
            g = torch.Generator(device=SMALL_DEVICE).manual_seed(seed)
            out.append(torch.rand((), generator=g, device=SMALL_DEVICE).item())
    return out


def _logits(batch: int) -> torch.Tensor:
    g = torch.Generator(device=SMALL_DEVICE).manual_seed(batch)
    return torch.randn((batch, VOCAB), generator=g, device=SMALL_DEVICE) * 3


def _bitmask(batch: int) -> torch.Tensor:
    """Row b allows the tokens t with t % (b + 2) == 0 (words past the vocabulary: all set)."""
    allowed = torch.zeros((batch, 96), dtype=torch.bool)
    for b in range(batch):
        allowed[b, :: b + 2] = True
    allowed[:, VOCAB:] = True
    words = (allowed.view(batch, 3, 32).long() << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).to(SMALL_DEVICE)


def test_fused_kernel_only_for_cuda_logits(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sampler.uses_fused_kernel(cuda, fused=True) is HAS_TRITON
    assert not sampler.uses_fused_kernel(cpu, fused=True)
    assert not sampler.uses_fused_kernel(cuda, fused=False)
    monkeypatch.setattr(sampler, "HAS_TRITON", False)
    assert not sampler.uses_fused_kernel(cuda, fused=True)


def test_cpu_logits_never_reach_the_fused_path(monkeypatch):
    def no_fused(*args, **kw):
        raise AssertionError("the fused path ran on CPU logits")

    monkeypatch.setattr(sampler, "masked_sample", no_fused)
    reqs = _reqs(ROWS, device="cpu")  # generators live where the logits do
    ids, _ = sampler.sample_on_device(_logits(len(ROWS)).cpu(), reqs, frozenset(), fused=True)
    assert ids.shape == (len(ROWS),)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_parameter_table_rows_and_alignment(monkeypatch, batch):
    """Each kernel argument holds the rows' values in order, and starts 16-byte aligned.

    NOTE: Triton specializes the kernel on its pointers' 16-byte alignment: the parameter vectors
    were column views of a [B, 4] tensor, misaligned for a lone row, which compiled the kernel
    anew (~7 s) in the middle of serving. The table is built on the host whatever the device."""
    rows = ROWS[:batch]
    seen: list[tuple] = []

    def spy(*args):
        seen.append(args)
        return torch.zeros(batch, dtype=torch.int64, device=SMALL_DEVICE), None

    constrained = [b for b in range(batch) if b % 2 == 1]
    bitmask = (_bitmask(batch), constrained)
    sampler._draw(spy, _logits(batch), _reqs(rows), bitmask)
    (args,) = seen
    logits, words, flags, temperature, top_k, top_p, min_p, uniform = args
    assert words is bitmask[0]
    assert flags.tolist() == [b in constrained for b in range(batch)]
    f32 = torch.tensor  # the expected values, rounded to float32 as the table holds them
    assert temperature.tolist() == f32([r[0] for r in rows], dtype=torch.float32).tolist()
    assert top_k.dtype == torch.int32 and top_k.tolist() == [r[1] for r in rows]
    assert top_p.tolist() == f32([r[2] for r in rows], dtype=torch.float32).tolist()
    assert min_p.tolist() == f32([r[3] for r in rows], dtype=torch.float32).tolist()
    assert uniform.tolist() == f32(_uniforms(rows), dtype=torch.float32).tolist()
    tensors = [logits, flags, temperature, top_k, top_p, min_p, uniform]
    for t in tensors:
        assert t.device.type == SMALL_DEVICE.type and t.shape[0] == batch
    assert [t.data_ptr() % 16 for t in tensors] == [0] * len(tensors)


@needs_triton
@pytest.mark.parametrize("constrained", [[], [1, 2, 4]], ids=["free", "constrained"])
def test_fused_path_tokens(monkeypatch, constrained):
    """sample_on_device's fused branch on a batch of greedy and sampled rows, some constrained:
    the tokens of the path CPU logits take, which are the twin's with the same uniforms."""
    batch = len(ROWS)
    logits = _logits(batch)
    bitmask = (_bitmask(batch), constrained) if constrained else None
    monkeypatch.setattr(sampler, "uses_fused_kernel", lambda device, fused: True)
    # a small candidate buffer: the interpreter's time grows with it (the launch settings are the
    # kernel's tests' concern)
    monkeypatch.setattr(sampler, "masked_sample", functools.partial(masked_sample, capacity=16))
    fused, _ = sampler.sample_on_device(
        logits.clone(), _reqs(ROWS), frozenset(), bitmask, fused=True
    )
    monkeypatch.setattr(sampler, "uses_fused_kernel", lambda device, fused: False)
    plain, _ = sampler.sample_on_device(
        logits.clone(), _reqs(ROWS), frozenset(), bitmask, fused=True
    )

    flags = torch.tensor([b in constrained for b in range(batch)], device=SMALL_DEVICE)
    want, _ = masked_sample_reference(
        logits,
        bitmask[0] if bitmask else None,
        flags if bitmask else None,
        torch.tensor([r[0] for r in ROWS], device=SMALL_DEVICE),
        torch.tensor([r[1] for r in ROWS], dtype=torch.int32, device=SMALL_DEVICE),
        torch.tensor([r[2] for r in ROWS], device=SMALL_DEVICE),
        torch.tensor([r[3] for r in ROWS], device=SMALL_DEVICE),
        torch.tensor(_uniforms(ROWS), device=SMALL_DEVICE),
    )
    greedy = [0, 3]
    assert fused.tolist() == want.tolist()
    assert [fused[i].item() for i in greedy] == [plain[i].item() for i in greedy]
    assert plain.tolist() == want.tolist()  # the CPU path is the twin
    if bitmask is not None:  # every token is one its row's grammar allows
        for b in constrained:
            assert fused[b].item() % (b + 2) == 0
