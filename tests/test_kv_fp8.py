"""An FP8 (e4m3) KV cache (`kv_cache_dtype fp8_e4m3`): the pool holds one byte a value, each
layer's K and V divided by its scale (the checkpoint's k_scale / v_scale, else 1.0), and what it
costs in accuracy against the compute-dtype pool on the same weights: stories260K's greedy text,
the default model's log-probabilities of a fixed text. The kernels' side is in
tests/test_kernels (kv_store, decode and extend attention over FP8 buffers); the CUDA test at
the end runs the Triton backend and CUDA graphs.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_quantized import TEXT  # the code text test_quantized scores too

from weft.runtime.kv_pool import KVScales
from weft.runtime.models.fp8 import FP8_DTYPE

from conftest import make_engine, require_default_model

PROMPTS = ["Once upon a time", "The little dog"]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


def _run(engine, prompts=PROMPTS) -> tuple[list[list[int]], list[list[float]], list]:
    """Greedy output ids, the prompts' log-probabilities and each output step's top two."""
    outs = engine.generate(
        prompts, GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    ids = [list(o["output_ids"]) for o in outs]
    prompt_lp = [[e[0] for e in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]
    top2 = [o["meta_info"]["output_top_logprobs"] for o in outs]
    return ids, prompt_lp, top2


def _assert_same_until_near_tie(ids, top2, fp8_ids, min_same: int) -> None:
    """FP8 keys and values move log-probabilities by up to a few tenths on stories260K (8-dim
    heads: little averages out): the greedy texts agree until a step where the compute-dtype
    pool's first two choices are that close, and FP8 takes the second."""
    for want, got, top in zip(ids, fp8_ids, top2, strict=True):
        if got == want:
            continue
        j = next(k for k in range(len(want)) if want[k] != got[k])
        (lp1, first, _), (lp2, second, _) = top[j]
        assert j >= min_same and (first, second) == (want[j], got[j]), (j, top[j], got[j])
        assert lp1 - lp2 < 1.0, top[j]


@pytest.fixture(scope="module")
def stories_both(stories_dir):
    results = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = make_engine(stories_dir, kv_cache_dtype=kv, max_total_tokens=1024)
        pool = engine.runner.kv_pool
        results[kv] = (pool.dtype, pool.bytes_per_token, *_run(engine))
        engine.shutdown()
    return results


def test_pool_stores_one_byte_a_value(stories_both):
    dtype, per_token, *_ = stories_both["auto"]
    fp8_dtype, fp8_per_token, *_ = stories_both["fp8_e4m3"]
    assert (dtype, fp8_dtype) == (torch.float32, FP8_DTYPE)
    assert per_token == 4 * fp8_per_token  # stories260K computes in float32


def test_stories_greedy_until_a_near_tie(stories_both):
    """Measured: the first prompt's 48 tokens equal; the second's from token 28 on, where the
    bfloat16 pool's top two were 0.70 apart; prompt log-probabilities within {max}."""
    _, _, ids, lp, top2 = stories_both["auto"]
    _, _, fp8_ids, fp8_lp, _ = stories_both["fp8_e4m3"]
    assert fp8_ids[0] == ids[0]
    _assert_same_until_near_tie(ids, top2, fp8_ids, min_same=16)
    diffs = [abs(a - b) for x, y in zip(lp, fp8_lp, strict=True) for a, b in zip(x, y, strict=True)]
    assert 0 < max(diffs) < 0.5, max(diffs)  # quantized, but close


def test_pool_size_from_memory_doubles(stories_dir):
    """Without max_total_tokens the pool is sized from memory (cpu_kv_cache_gb on a CPU): e4m3
    fits 4x the float32 tokens (2x the bfloat16 ones)."""
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        # 2.56 MB: 2,000 tokens of 1,280 bytes (float32), inside the 1,024 .. 4 x context bounds
        engine = make_engine(
            stories_dir,
            device="cpu",  # (a GPU sizes its pool from free memory: test_cuda_fp8_pool)
            kv_cache_dtype=kv,
            cpu_kv_cache_gb=0.00256,
            context_length=4096,
        )
        sizes[kv] = engine.runner.kv_pool.size
        engine.shutdown()
    assert sizes["fp8_e4m3"] == 4 * sizes["auto"], sizes


def _with_scales(src, dst, tensors: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_scales(stories_dir, stories_both, tmp_path):
    """k_scale / v_scale tensors as FP8 checkpoints publish them: an FP8 pool divides by them
    (its text then differs from scale 1.0's only where e4m3's subnormals round differently, so
    until a near-tie); a pool in the compute dtype ignores them (the same text)."""
    layers = 5
    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
        scales[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor([0.25])
    folder = _with_scales(stories_dir, tmp_path / "scaled", scales)
    _, _, ids, _, top2 = stories_both["auto"]
    for kv in ("fp8_e4m3", "auto"):
        engine = make_engine(folder, kv_cache_dtype=kv, max_total_tokens=1024)
        pool = engine.runner.kv_pool
        got, *_ = _run(engine)
        engine.shutdown()
        if kv == "auto":
            assert (pool.scales.k, pool.scales.v, pool.scales.from_checkpoint) == (
                [1.0] * layers,
                [1.0] * layers,
                0,
            )
            assert got == ids
        else:
            assert (pool.scales.k, pool.scales.v) == ([0.5] * layers, [0.25] * layers)
            assert pool.scales.from_checkpoint == 2 * layers
            _assert_same_until_near_tie(ids, top2, got, min_same=16)


def test_kv_scale_names_both():
    """The older single kv_scale sets K's and V's; other tensors pass through."""
    scales = KVScales(2)
    weights = [
        ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0)),
        ("model.layers.1.self_attn.q_proj.weight", torch.zeros(1)),
    ]
    assert [n for n, _ in scales.take(weights)] == ["model.layers.1.self_attn.q_proj.weight"]
    assert (scales.k, scales.v) == ([1.0, 2.0], [1.0, 2.0])


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.ones(4), r"k_scale: a KV cache scale must be one number .* shape \(4,\)"),
        (torch.tensor(-1.0), "k_scale: a KV cache scale must be positive and finite, got -1.0"),
    ],
)
def test_bad_scale_names_the_tensor(stories_dir, tmp_path, tensor, message):
    name = "model.layers.2.self_attn.k_proj.k_scale"
    folder = _with_scales(stories_dir, tmp_path / "bad", {name: tensor})
    with pytest.raises(ValueError, match=f"model.layers.2.self_attn.k_proj.{message}"):
        make_engine(folder, kv_cache_dtype="fp8_e4m3", max_total_tokens=1024)


def test_refused_value_names_the_field():
    from weft.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


# -- the default model (real weights): what FP8 KV costs --------------------------------------


def test_default_model_perplexity():
    """Log-probabilities of a fixed text (102 tokens) through a bfloat16 and an FP8 pool (scales
    1.0: the GGUF has none; its keys reach 220, inside e4m3's 448). Measured: perplexity 3.678
    -> 3.595 (-2.3 %), per-token difference max 1.78, mean 0.078."""
    require_default_model()
    logprobs = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = make_engine(None, kv_cache_dtype=kv, max_total_tokens=1024)
        ids = engine.tokenizer.encode(TEXT)
        out = engine.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
        logprobs[kv] = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        engine.shutdown()
    lp, lp8 = logprobs["auto"], logprobs["fp8_e4m3"]
    diffs = [abs(a - b) for a, b in zip(lp, lp8, strict=True)]
    ppl, ppl8 = math.exp(-sum(lp) / len(lp)), math.exp(-sum(lp8) / len(lp8))
    stats = (ppl, ppl8, max(diffs), sum(diffs) / len(diffs))
    assert len(lp) > 100 and abs(ppl8 / ppl - 1) < 0.04, stats
    assert max(diffs) < 2.5 and sum(diffs) / len(diffs) < 0.1, stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_fp8_pool(stories_dir, stories_both, backend):
    """On a GPU: the kv_store kernel and the attention kernels (or the torch backend) over an FP8
    pool, CUDA graphs on, against the CPU's compute-dtype pool."""
    _, _, ids, lp, top2 = stories_both["auto"]
    engine = make_engine(
        stories_dir,
        device="cuda",
        kv_cache_dtype="fp8_e4m3",
        attention_backend=backend,
        max_total_tokens=1024,
    )
    got, got_lp, _ = _run(engine)
    engine.shutdown()
    _assert_same_until_near_tie(ids, top2, got, min_same=16)
    diffs = [abs(a - b) for x, y in zip(lp, got_lp, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < 0.5, max(diffs)
