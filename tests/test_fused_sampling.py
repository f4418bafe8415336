"""On CUDA the sampler runs the fused Triton mask + sample kernel: greedy and constrained
outputs equal the torch path's, and seeded samples repeat."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engine(stories_dir):
    return make_engine(stories_dir, device="cuda", max_total_tokens=4096)


def _generate(engine, params, fused: bool):
    import weft.runtime.sampler as sampler

    before = sampler.USE_FUSED_KERNEL
    sampler.USE_FUSED_KERNEL = fused
    try:
        return engine.generate(["Once upon a time", "The cat"], params)
    finally:
        sampler.USE_FUSED_KERNEL = before


def test_greedy_equals_the_torch_path(engine):
    params = {"temperature": 0, "max_new_tokens": 48}
    fused = _generate(engine, params, True)
    plain = _generate(engine, params, False)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in plain]


def test_constrained_greedy_equals_the_torch_path_and_matches(engine):
    params = {
        "temperature": 0,
        "max_new_tokens": 24,
        "regex": r" (Lily|Tom) (was|had) [a-z ]{1,20}\.",
    }
    fused = _generate(engine, params, True)
    plain = _generate(engine, params, False)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in plain]
    for out in fused:
        assert re.fullmatch(r" ?(Lily|Tom) (was|had) [a-z ]{1,20}\.", out["text"]), out["text"]


def test_seeded_samples_repeat_and_obey_top_k(engine):
    params = {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "max_new_tokens": 32, "seed": 11}
    first = _generate(engine, params, True)
    again = _generate(engine, params, True)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
