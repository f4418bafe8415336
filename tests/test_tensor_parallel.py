"""Tensor parallelism on CPUs: two gloo ranks (spawned processes) against one rank, for every
architecture of hf_models.CONFIGS, through the real ModelRunner (KV pool by local KV heads, torch
attention, chunked prefill and decode); and the rules by which the layers split.

The two-rank logits differ from the one-rank ones only by the order of float32 sums (each rank
sums its part of a dot product, then the ranks' parts are summed): LOGITS_ATOL bounds that, and
the greedy tokens must be identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from weft.runtime.models.vocab_parallel import vocab_rows
from weft.runtime.parallel import SINGLE, RankSlice, TPGroup

from hf_models import CONFIGS, save_random_model
from tp_ranks import (
    FP8_MODEL,
    TP_SIZE,
    build_runner,
    greedy_steps,
    layer_weights,
    spawn_ranks,
)

LOGITS_ATOL = 1e-5  # float32: logits of magnitude ~1, seen to differ by up to 3.4e-7

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this torch build",
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Per model: (one rank's logits and tokens, each of the two ranks' results)."""
    root = tmp_path_factory.mktemp("tp")
    folders = {}
    for name in sorted(CONFIGS):
        folders[name] = root / name
        save_random_model(name, folders[name])
    spawn_ranks(str(root / "store"), {n: str(f) for n, f in folders.items()}, str(root))
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(TP_SIZE)]
    single = {name: greedy_steps(build_runner(folder, SINGLE)) for name, folder in folders.items()}
    return single, ranks


@needs_gloo
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_ranks_give_one_ranks_logits_and_tokens(two_ranks, name):
    single, ranks = two_ranks
    logits, tokens = single[name]
    kv_heads = CONFIGS[name]["num_key_value_heads"]
    for rank, results in enumerate(ranks):
        got = results[name]
        assert got["tokens"] == tokens, f"rank {rank}"
        # an even share of the KV heads, or the one (replicated) KV head of MQA
        assert got["kv_heads"] == max(kv_heads // TP_SIZE, 1)
        for step, (ours, ref) in enumerate(zip(got["logits"], logits, strict=True)):
            torch.testing.assert_close(
                ours, ref, atol=LOGITS_ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}"
            )


@needs_gloo
def test_weights_quantized_to_fp8_at_load_split_too(two_ranks):
    """quantization fp8 quantizes the slice each rank holds (its rows, per row of its columns):
    not one rank's numbers, but as near the float32 model as FP8 gets (max |error| seen: 0.031
    on two ranks, 0.020 on one; a missing or doubled sum shows ~0.5)."""
    single, ranks = two_ranks
    reference, _ = single[FP8_MODEL]
    for results in ranks:
        for ours, ref in zip(results["fp8"], reference, strict=True):
            torch.testing.assert_close(ours, ref, atol=0.08, rtol=0)


@needs_gloo
def test_vocab_parallel_and_row_parallel_layers(two_ranks):
    _, ranks = two_ranks
    w = layer_weights()
    expected = {
        "embed": F.embedding(w["ids"], w["table"]),
        "tied_logits": w["hidden"] @ w["table"].T,
        "head_logits": w["hidden"] @ w["head"].T,
        "row": F.linear(w["row_x"], w["row_weight"], w["row_bias"]),
        "min_int": torch.tensor(10),
    }
    for results in ranks:
        for key, value in expected.items():
            torch.testing.assert_close(results["layers"][key], value, atol=1e-6, rtol=1e-6)


def test_splits():
    assert TPGroup(1, 2).split(8, what="x") == RankSlice(8, 4, 4)
    assert SINGLE.split(7, what="x") == RankSlice.whole(7)
    with pytest.raises(ValueError, match=r"x \(7\) does not split over 2 tensor-parallel ranks"):
        TPGroup(0, 2).split(7, what="x")
    assert RankSlice(8, 2, 2).scaled(16) == RankSlice(128, 32, 32)
    with pytest.raises(ValueError, match="rank 2 outside"):
        TPGroup(2, 2)


def test_kv_heads_split_or_replicate():
    # as many KV heads as ranks, or more: an even share
    assert [TPGroup(r, 4).split_kv_heads(8) for r in range(4)] == [
        RankSlice(8, 2 * r, 2) for r in range(4)
    ]
    # fewer: the KV head each rank's q heads read (8 q heads: ranks 0-1 read 0-3 -> KV head 0)
    assert [TPGroup(r, 4).split_kv_heads(2).start for r in range(4)] == [0, 0, 1, 1]
    assert [TPGroup(r, 2).split_kv_heads(1) for r in range(2)] == [RankSlice(1, 0, 1)] * 2
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is fewer than the 4"):
        TPGroup(0, 4).split_kv_heads(3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\) does not split over 4"):
        TPGroup(0, 4).split_kv_heads(6)


def test_vocab_rows_pad_the_last_rank():
    assert vocab_rows(7, SINGLE) == (RankSlice(7, 0, 7), 7)
    assert vocab_rows(7, TPGroup(0, 2)) == (RankSlice(7, 0, 4), 4)
    assert vocab_rows(7, TPGroup(1, 2)) == (RankSlice(7, 4, 3), 4)
    assert vocab_rows(5, TPGroup(3, 4)) == (RankSlice(5, 5, 0), 2)


_LLAMA = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=10,
    hidden_size=16,
    intermediate_size=24,
    num_layers=1,
    num_heads=6,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32,
    tie_word_embeddings=False,
    attention_bias=True,
)


def test_a_rank_holds_its_slice_of_every_layer():
    # 6 q heads, 1 KV head over 2 ranks: rank 1 holds q heads 3-5 and the KV head
    cfg = dataclasses.replace(_LLAMA, num_kv_heads=1)
    model = LlamaForCausalLM(cfg, torch.float32, tp=TPGroup(1, 2))
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
    assert attn.qkv_proj.weight.shape == ((3 + 1 + 1) * 4, 16)
    assert attn.qkv_proj.bias.shape == ((3 + 1 + 1) * 4,)
    assert attn.o_proj.weight.shape == (16, 3 * 4)
    mlp = model.layers[0].mlp
    assert mlp.gate_up_proj.weight.shape == (2 * 12, 16)
    assert mlp.down_proj.weight.shape == (16, 12)
    assert model.embed_tokens.weight.shape == (5, 16)
    assert model.lm_head.weight.shape == (5, 16)
    assert model.norm.weight.shape == (16,)


def test_a_rank_loads_its_rows_and_columns():
    model = LlamaForCausalLM(_LLAMA, torch.float32, tp=TPGroup(1, 2))
    q = torch.arange(24 * 16, dtype=torch.float32).view(24, 16)
    o = torch.arange(16 * 24, dtype=torch.float32).view(16, 24)
    model.load_weights(
        [
            ("model.layers.0.self_attn.q_proj.weight", q),
            ("model.layers.0.self_attn.q_proj.bias", q[:, 0]),
            ("model.layers.0.self_attn.o_proj.weight", o),
        ]
    )
    attn = model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.weight[:12], q[12:])
    assert torch.equal(attn.qkv_proj.bias[:12], q[12:, 0])
    assert torch.equal(attn.o_proj.weight, o[:, 12:])
    with pytest.raises(ValueError, match="expected 8 along dim 0"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(4, 16))])


def test_moe_experts_split_per_expert_and_stacked():
    raw = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        moe_intermediate_size=6,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
    )
    model = Qwen3MoeForCausalLM(ModelConfig.from_dict(raw), torch.float32, tp=TPGroup(0, 2))
    experts = model.layers[0].mlp.experts
    gate_up = torch.arange(2 * 12 * 8, dtype=torch.float32).view(2, 12, 8)
    down = torch.arange(2 * 8 * 6, dtype=torch.float32).view(2, 8, 6)
    model.load_weights(
        [
            ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
            ("model.layers.0.mlp.experts.down_proj", down),
        ]
    )
    assert torch.equal(experts.gate_up_proj, torch.cat((gate_up[:, :3], gate_up[:, 6:9]), 1))
    assert torch.equal(experts.down_proj, down[:, :, :3])
    up = torch.randn(6, 8)
    model.load_weights([("model.layers.0.mlp.experts.1.up_proj.weight", up)])
    assert torch.equal(experts.gate_up_proj[1, 3:], up[:3])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_heads=4), r"num_attention_heads \(4\) does not split over 3"),
        (dict(num_kv_heads=2), r"num_key_value_heads \(2\) is fewer than the 3"),
        (dict(intermediate_size=20), r"intermediate_size \(20\) does not split over 3"),
    ],
)
def test_sizes_that_do_not_split_are_refused(change, message):
    cfg = dataclasses.replace(_LLAMA, **{"num_kv_heads": 3, **change})
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(cfg, torch.float32, tp=TPGroup(0, 3))


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        (
            "model.layers.0.self_attn.q_proj.qweight",
            torch.zeros(24, 8, dtype=torch.uint8),
            "q_proj.qweight: a GGUF-quantized",
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            torch.zeros(16, 24).to(torch.float8_e4m3fn),
            r"down_proj.weight: an FP8 \(float8_e4m3fn\)",
        ),
    ],
)
def test_quantized_weights_are_refused_over_ranks(name, tensor, message):
    model = LlamaForCausalLM(_LLAMA, torch.bfloat16, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match=message + ".* over 2 tensor-parallel ranks"):
        model.load_weights([(name, tensor)])
