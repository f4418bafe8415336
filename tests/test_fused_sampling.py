"""On CUDA the sampler runs the fused Triton mask + sample kernel: greedy and constrained
outputs equal the torch path's, and seeded samples repeat."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engines(stories_dir):
    """fused -> an engine: the fused kernel, or the torch twin (disable_fused_sampling)."""
    return {
        fused: make_engine(
            stories_dir,
            device="cuda",
            max_total_tokens=4096,
            disable_fused_sampling=not fused,
        )
        for fused in (True, False)
    }


def _generate(engines, params, fused: bool):
    return engines[fused].generate(["Once upon a time", "The cat"], params)


def test_greedy_equals_the_torch_path(engines):
    params = {"temperature": 0, "max_new_tokens": 48}
    fused = _generate(engines, params, True)
    plain = _generate(engines, params, False)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in plain]


def test_constrained_greedy_equals_the_torch_path_and_matches(engines):
    params = {
        "temperature": 0,
        "max_new_tokens": 24,
        "regex": r" (Lily|Tom) (was|had) [a-z ]{1,20}\.",
    }
    fused = _generate(engines, params, True)
    plain = _generate(engines, params, False)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in plain]
    for out in fused:
        assert re.fullmatch(r" ?(Lily|Tom) (was|had) [a-z ]{1,20}\.", out["text"]), out["text"]


def test_seeded_samples_repeat_and_obey_top_k(engines):
    params = {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "max_new_tokens": 32, "seed": 11}
    first = _generate(engines, params, True)
    again = _generate(engines, params, True)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_kernel_arguments_start_16_byte_aligned(monkeypatch, batch):
    """NOTE: Triton specializes the kernel on its pointers' 16-byte alignment: the parameter
    vectors were column views of a [B, 4] tensor, misaligned for a lone row, which compiled the
    kernel anew (~7 s) in the middle of serving."""
    import weft.runtime.sampler as sampler
    from weft.runtime.core import Req
    from weft.runtime.sampling_params import SamplingParams

    seen: list[torch.Tensor] = []

    def spy(*args, **kwargs):
        seen.extend(a for a in args if isinstance(a, torch.Tensor))
        return real(*args, **kwargs)

    real = sampler.masked_sample
    monkeypatch.setattr(sampler, "masked_sample", spy)
    reqs = [Req(f"r{i}", [1], SamplingParams(temperature=0.5, top_k=3)) for i in range(batch)]
    logits = torch.randn(batch, 64, device="cuda")
    ids, _ = sampler.sample_on_device(logits, reqs, frozenset(), fused=True)
    assert ids.shape == (batch,)
    assert len(seen) == 6  # logits, temperature, top_k, top_p, min_p, uniform
    assert all(t.data_ptr() % 16 == 0 for t in seen), [t.data_ptr() % 16 for t in seen]
