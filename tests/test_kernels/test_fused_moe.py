"""The fused MoE kernels vs their torch twin (float64), and the routing kernels (top-k, the
grouping by expert) vs theirs."""

from __future__ import annotations

import pytest
import torch

from weft.kernels import moe_routing
from weft.kernels.fused_moe import MoeTiles, default_tiles, fused_experts, fused_moe
from weft.kernels.fused_moe_ref import experts_ref, fused_moe_ref, route_topk
from weft.kernels.moe_routing import (
    align_by_expert,
    align_by_expert_ref,
    padded_capacity,
    topk_softmax,
)

from .kernel_utils import REL_TOL, SMALL_DEVICE, generator, randn, rel_err

TINY = MoeTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def test_route_topk_renormalises_on_request():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]])
    weights, ids = route_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normed, _ = route_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))


@pytest.mark.parametrize("align", [align_by_expert, align_by_expert_ref])
def test_align_by_expert_groups_and_pads(align):
    # 3 tokens, k = 2, 4 experts; expert 2 gets nothing, expert 1 gets three entries
    ids = torch.tensor([[1, 0], [1, 3], [3, 1]], device=SMALL_DEVICE)
    entries, blocks = align(ids, num_experts=4, block_m=4)
    n = 6
    # capacity: 6 entries + 4 experts * 3 padding rows, rounded up to whole blocks
    assert entries.numel() == padded_capacity(n, 4, 4) == 20
    # expert 0: entry 1; expert 1: entries 0, 2, 5; expert 3: entries 3, 4 (each padded to 4)
    assert entries.tolist() == [1, n, n, n, 0, 2, 5, n, 3, 4, n, n] + [n] * 8
    assert blocks.tolist() == [0, 1, 3, 4, 4]  # 4 (= E): unused blocks


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 8, 128, 16), (9, 3, 6, 16), (40, 2, 5, 4), (100, 8, 128, 16), (700, 6, 40, 16)],
)
def test_align_kernel_matches_twin(request, tokens, top_k, experts, block_m):
    """Random routings: 6 experts (BLOCK_E 8 holds two that do not exist), 800 entries (the
    kernel loops over chunks of 32), and 4200 entries, past the kernel's limit (the twin runs)."""
    g = generator(request.node.nodeid, SMALL_DEVICE)
    scores = torch.rand((tokens, experts), generator=g, device=SMALL_DEVICE)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    got = align_by_expert(ids, experts, block_m)
    want = align_by_expert_ref(ids, experts, block_m)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert (tokens * top_k > moe_routing.ALIGN_KERNEL_MAX_ENTRIES) == (tokens == 700)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (6, 3), (5, 5)])
def test_topk_softmax_matches_twin(request, renormalize, experts, top_k):
    g = generator(request.node.nodeid, SMALL_DEVICE)
    # NOTE: float32 logits: bf16 ones tie often, and torch.topk orders ties its own way
    logits = randn((7, experts), torch.float32, SMALL_DEVICE, g)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    want_w, want_ids = route_topk(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_topk_softmax_ties_take_the_lowest_experts_once():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0]], device=SMALL_DEVICE)
    weights, ids = topk_softmax(logits.bfloat16(), 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=SMALL_DEVICE))


def test_default_tiles_follow_rows_per_expert():
    """Qwen3-30B-A3B (128 experts, top-8): the decode tiles up to 256 tokens (the largest CUDA
    graph), larger blocks as prefill gives each expert more rows."""
    assert {default_tiles(t, 8, 128).block_m for t in (1, 16, 64, 256)} == {16}
    assert default_tiles(512, 8, 128).block_m == 32
    assert default_tiles(8192, 8, 128).block_m == 64


def _case(name, device, dtype, *, tokens, hidden, inter, experts, top_k, renormalize, tiles):
    g = generator(name, device)
    x = randn((tokens, hidden), dtype, device, g)
    logits = randn((tokens, experts), torch.float32, device, g)
    logits[:, -1] = -1e4  # the last expert never wins: a block-free expert
    w13 = randn((experts, 2 * inter, hidden), dtype, device, g) / hidden**0.5
    w2 = randn((experts, hidden, inter), dtype, device, g) / inter**0.5
    got = fused_moe(x, logits, w13, w2, top_k=top_k, renormalize=renormalize, tiles=tiles)
    want = fused_moe_ref(
        x.double(), logits, w13.double(), w2.double(), top_k=top_k, renormalize=renormalize
    )
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "renormalize"),
    [
        (1, 32, 16, 4, 2, True),  # decode: one token, two experts
        (7, 40, 24, 6, 3, False),  # ragged H and I (masked K and N), tokens share experts
        (20, 32, 16, 3, 2, True),  # more than BLOCK_M rows for one expert: several blocks
    ],
)
def test_fused_moe_matches_twin(request, dtype, tokens, hidden, inter, experts, top_k, renormalize):
    _case(
        request.node.nodeid,
        SMALL_DEVICE,
        dtype,
        tokens=tokens,
        hidden=hidden,
        inter=inter,
        experts=experts,
        top_k=top_k,
        renormalize=renormalize,
        tiles=TINY,
    )


def test_fused_experts_same_expert_twice_in_a_batch(request):
    """Every token picks experts 2 and 0; experts 1 and 3 have no rows."""
    g = generator(request.node.nodeid, SMALL_DEVICE)
    x = randn((5, 32), torch.float32, SMALL_DEVICE, g)
    w13 = randn((4, 32, 32), torch.float32, SMALL_DEVICE, g)
    w2 = randn((4, 32, 16), torch.float32, SMALL_DEVICE, g)
    ids = torch.tensor([[2, 0]] * 5, device=SMALL_DEVICE)
    weights = torch.rand((5, 2), generator=g, device=SMALL_DEVICE)
    got = fused_experts(x, w13, w2, weights, ids, tiles=TINY)
    want = experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert rel_err(got, want) < REL_TOL[torch.float32]


def test_fused_experts_checks():
    x = torch.ones((2, 32), device=SMALL_DEVICE)
    w13 = torch.ones((4, 32, 32), device=SMALL_DEVICE)
    ids = torch.zeros((2, 2), dtype=torch.int64, device=SMALL_DEVICE)
    weights = torch.ones((2, 2), device=SMALL_DEVICE)
    with pytest.raises(ValueError, match="w2: expected shape"):
        fused_experts(x, w13, torch.ones((4, 16, 32), device=SMALL_DEVICE), weights, ids)
    with pytest.raises(ValueError, match="weights: dtype"):
        fused_experts(x, w13, torch.ones((4, 32, 16), device=SMALL_DEVICE), weights.double(), ids)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_fused_moe_qwen3_30b_shapes_cuda(request, tokens):
    """Qwen3-30B-A3B's layer (H 2048, 128 experts, top-8, I 768) in bf16: the decode tiles at
    1..64 tokens, the prefill tiles at 300."""
    _case(
        request.node.nodeid,
        torch.device("cuda"),
        torch.bfloat16,
        tokens=tokens,
        hidden=2048,
        inter=768,
        experts=128,
        top_k=8,
        renormalize=True,
        tiles=None,
    )


@pytest.mark.cuda
def test_fused_moe_in_a_cuda_graph(request):
    """Captured once, replayed with other routing: no sizes taken from the routing's values."""
    dev = torch.device("cuda")
    g = generator(request.node.nodeid, dev)
    x = randn((8, 256), torch.bfloat16, dev, g)
    logits = randn((8, 16), torch.float32, dev, g)
    w13 = randn((16, 2 * 128, 256), torch.bfloat16, dev, g) / 16
    w2 = randn((16, 256, 128), torch.bfloat16, dev, g) / 12

    def step():
        return fused_moe(x, logits, w13, w2, top_k=4, renormalize=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        logits.copy_(randn((8, 16), torch.float32, dev, g))
        x.copy_(randn((8, 256), torch.bfloat16, dev, g))
        graph.replay()
        want = fused_moe_ref(
            x.double(), logits, w13.double(), w2.double(), top_k=4, renormalize=True
        )
        assert rel_err(out, want) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_moe_layer_matches_transformers(request, renormalize):
    """weft's SparseMoE (the model's layer) on transformers' Qwen3-MoE block weights: the torch
    twin and the kernels (fused) both give the block's output."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from weft.runtime.model_config import ModelConfig
    from weft.runtime.models.moe import SparseMoE

    shape = dict(hidden_size=32, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2)
    hf_config = transformers_config(norm_topk_prob=renormalize, **shape)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    raw = {**hf_config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    ours = SparseMoE(ModelConfig.from_dict(raw), torch.float32).to(SMALL_DEVICE)
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ours.experts.down_proj.copy_(block.experts.down_proj)
        x = torch.randn(6, 32)
        want = block(x[None])[0]
        for fused in (False, True):
            got = ours(x.to(SMALL_DEVICE), fused).cpu()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def transformers_config(**fields):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        **fields,
    )
