"""bfloat16 products in float32 on a CPU without bfloat16 in hardware (models/cpu_gemm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft.runtime import hardware
from weft.runtime.models import cpu_gemm
from weft.runtime.models.layers import linear

from conftest import qwen_engine


def test_a_torch_capped_below_avx512_has_no_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert hardware.cpu_bf16_flags() == ["avx512_bf16"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert hardware.cpu_bf16_flags() == []


@pytest.mark.parametrize("bias", [False, True])
def test_banded_product_is_the_float32_product(monkeypatch, bias):
    # bands of 16 rows over 70 outputs: four whole bands and a partial one
    monkeypatch.setattr(cpu_gemm, "BAND_BYTES", 16 * 4 * 48)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 48, generator=gen).bfloat16()
    w = torch.randn(70, 48, generator=gen).bfloat16()
    b = torch.randn(70, generator=gen).bfloat16() if bias else None
    out = cpu_gemm.f32_linear(x, w, b)
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (20, 70)
    # one rounding to bfloat16 of the float32 sum: within half a bf16 step (2^-9 relative)
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6)


def test_linear_widens_only_products_of_many_rows(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "widen_bf16_gemm", lambda: True)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=gen).bfloat16()
    many = torch.randn(cpu_gemm.F32_MIN_ROWS, 32, generator=gen).bfloat16()
    few = many[: cpu_gemm.F32_MIN_ROWS - 1].contiguous()
    assert torch.equal(linear(many, w), cpu_gemm.f32_linear(many, w, None))
    assert torch.equal(linear(few, w), F.linear(few, w))
    assert not cpu_gemm.wants_f32(many.float())  # float32 models multiply as they are


def test_default_model_scores_the_same_with_float32_products(monkeypatch):
    """A prefill's products in float32 against bfloat16 hardware GEMM (or its emulation): the
    prompt's log-probabilities within bf16 rounding, the same greedy answer."""
    engine = qwen_engine()
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    runs = {}
    for widen in (False, True):
        monkeypatch.setattr(cpu_gemm, "widen_bf16_gemm", lambda widen=widen: widen)
        assert engine.flush_cache()
        out = engine.generate(text, params, return_logprob=True, logprob_start_len=0)
        logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
        runs[widen] = (torch.tensor(logprobs), out["output_ids"])
    (bf16, bf16_ids), (f32, f32_ids) = runs[False], runs[True]
    assert len(bf16) >= cpu_gemm.F32_MIN_ROWS
    assert f32_ids == bf16_ids
    assert (f32 - bf16).abs().max() < 0.25  # measured 0.024 (mean 0.003); AVX2: 0.109 (0.010)
    assert (f32 - bf16).abs().mean() < 0.03


def test_prompts_multiply_gguf_weights_with_weft_kernels_on_a_cpu_without_bf16(monkeypatch):
    """There torch emulates a bf16 GEMM: GGUF weights skip their bf16 copy and prompts go through
    weft's kernels, unless the float32 products were asked for; with bf16 in hardware, or torch's
    packed kernels only (no weft kernels), or a dense model, the copy stays."""
    from weft.runtime import model_runner
    from weft.runtime.config import EngineConfig

    class Weight:
        native: object | None = object()

    config = EngineConfig()
    monkeypatch.setattr(model_runner, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(model_runner, "widen_bf16_gemm", lambda: False)
    assert model_runner.quantized_prefill(config, [Weight()])
    assert not model_runner.quantized_prefill(config, [])
    torch_kernels = Weight()
    torch_kernels.native = None
    assert not model_runner.quantized_prefill(config, [torch_kernels])
    monkeypatch.setattr(model_runner, "widen_bf16_gemm", lambda: True)
    assert not model_runner.quantized_prefill(config, [Weight()])
    monkeypatch.setattr(model_runner, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    assert not model_runner.quantized_prefill(config, [Weight()])
    assert model_runner.quantized_prefill(config.replace(quantized_prefill=True), [Weight()])
