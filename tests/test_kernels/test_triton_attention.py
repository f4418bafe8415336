"""TritonAttention against TorchAttention (the reference backend) on the same pool and batch."""

from __future__ import annotations

import json

import pytest
import torch

from weft.runtime.attention import FULL_ATTENTION, AttentionOptions, TorchAttention
from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import KVPool, ReqToTokenPool
from weft.runtime.triton_attention import TritonAttention

from .kernel_utils import HAS_CUDA, INTERPRETED, SMALL_DEVICE, generator, randn, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NUM_LAYERS = 2


def _setup(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[KVPool, ReqToTokenPool, ForwardBatch, torch.Generator]:
    """A pool whose prefixes hold random KV, scattered over shuffled slots, and the step's batch.

    NOTE: past each request's length its table row points at slots filled with NaN (stale slots
    of finished requests): neither backend may read them.
    """
    g = generator(name, device)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    max_ctx = max(seq_lens) + 8
    stale = 8
    pool = KVPool(
        sum(seq_lens) + stale * len(seq_lens) + 16,
        NUM_LAYERS,
        num_kv_heads,
        head_dim,
        dtype,
        device,
    )
    table = ReqToTokenPool(len(seq_lens) + 3, max_ctx, device)
    table.allocate()  # leave row 0 unused: rows need not start at 0
    perm = torch.randperm(pool.size, generator=g, device=device).cpu()
    all_slots = pool.allocate(pool.size)[perm]  # shuffled: a request's slots are scattered
    out_loc, rows, used = [], [], 0
    for prefix, seq in zip(prefix_lens, seq_lens, strict=True):
        row = table.allocate()
        slots = all_slots[used : used + seq]
        junk = all_slots[used + seq : used + seq + stale]
        used += seq + stale
        table.write(row, 0, torch.cat([slots, junk]))
        for layer in range(NUM_LAYERS):
            for buf in (pool.k_buffers[layer], pool.v_buffers[layer]):
                buf[slots[:prefix].to(device)] = randn(
                    (prefix, num_kv_heads, head_dim), dtype, device, g
                )
                buf[junk.to(device)] = float("nan")
        out_loc.append(slots[prefix:])
        rows.append(row)
    num_tokens = sum(extend_lens)
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)])

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    batch = ForwardBatch(
        input_ids=torch.ones(num_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        out_cache_loc=torch.cat(out_loc).to(device),
        req_pool_indices=dev(rows),
        seq_lens=dev(seq_lens),
        prefix_lens=dev(prefix_lens),
        extend_lens=dev(extend_lens),
        logits_indices=torch.arange(num_tokens, device=device),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
    )
    return pool, table, batch, g


def _compare(
    name,
    device,
    dtype,
    prefix_lens,
    extend_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    options=(FULL_ATTENTION,),
):
    """Each layer runs once per options in `options` (different windows share a step's prepare)."""
    pool, table, batch, g = _setup(
        name, device, dtype, prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim
    )
    reference, triton_backend = TorchAttention(pool, table), TritonAttention(pool, table)
    reference.prepare(batch)
    triton_backend.prepare(batch)
    leading = next((i for i, n in enumerate(extend_lens) if n != 1), len(extend_lens))
    assert triton_backend._num_decode == leading  # the decode kernel takes the leading decodes
    num_tokens = batch.num_tokens
    for layer in range(NUM_LAYERS):
        for opts in options:
            # q, k as the model passes them: head slices of one [T, Hq + Hkv, D] tensor
            qk = randn((num_tokens, num_heads + num_kv_heads, head_dim), dtype, device, g)
            q, k = qk.split([num_heads, num_kv_heads], dim=1)
            v = randn((num_tokens, num_kv_heads, head_dim), dtype, device, g)
            got = triton_backend.forward(q, k, v, layer, batch, options=opts)
            stored_k = pool.k_buffers[layer][batch.out_cache_loc].clone()
            want = reference.forward(q, k, v, layer, batch, options=opts)
            assert torch.equal(stored_k, k)  # the Triton store wrote the new keys first
            assert got.shape == want.shape == (num_tokens, num_heads * head_dim)
            err = rel_err(got, want.float())
            assert err < TOL[dtype], f"layer {layer} {opts}: {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([0, 12, 39, 4], [1, 1, 1, 1]),  # decode (prefix 0: a one-token prompt)
        ([0, 0], [9, 23]),  # prefill, no cache
        ([17, 5, 30], [6, 20, 2]),  # extend after cached prefixes
        ([8, 0, 25, 3], [1, 14, 1, 1]),  # mixed: decode requests inside an extend step
        ([30, 8, 0, 12], [1, 1, 14, 1]),  # mixed as scheduled: decodes first, then a chunk
    ],
    ids=["decode", "prefill", "extend", "mixed", "decodes-first"],
)
def test_triton_matches_torch(request, dtype, prefix_lens, extend_lens):
    _compare(request.node.nodeid, SMALL_DEVICE, dtype, prefix_lens, extend_lens, 4, 2, 16)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(2, 2, 32), (8, 1, 8)])
def test_triton_matches_torch_head_layouts(request, num_heads, num_kv_heads, head_dim):
    for ext in ([1, 1], [5, 3]):
        _compare(
            request.node.nodeid,
            SMALL_DEVICE,
            torch.float32,
            [7, 2],
            ext,
            num_heads,
            num_kv_heads,
            head_dim,
        )


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([0, 12, 39, 4], [1, 1, 1, 1]),
        ([0, 0], [9, 23]),
        ([17, 5, 30], [6, 20, 2]),
        ([30, 8, 0, 12], [1, 1, 14, 1]),
    ],
    ids=["decode", "prefill", "extend", "decodes-first"],
)
def test_triton_matches_torch_windows_and_softcap(request, prefix_lens, extend_lens):
    """Per-layer options as Gemma 3 mixes them: windows shorter and longer than the contexts,
    soft-capping with and without a window, a score scale of the model's own, and full
    attention, in one step."""
    options = (
        AttentionOptions(sliding_window=6),
        AttentionOptions(logit_cap=3.0, scale=0.11),
        FULL_ATTENTION,
        AttentionOptions(sliding_window=16, logit_cap=5.0),
        AttentionOptions(sliding_window=1, scale=0.5),
        AttentionOptions(sliding_window=6),  # the step's masks for a window are built once
    )
    _compare(
        request.node.nodeid,
        SMALL_DEVICE,
        torch.float32,
        prefix_lens,
        extend_lens,
        4,
        2,
        16,
        options,
    )


def test_stories_greedy_with_triton_attention(stories_dir):
    """The real trained model, fp32: greedy tokens with TritonAttention match the golden ones,
    also when the second request reuses the first one's KV from the prefix cache."""
    from weft import Engine

    golden = json.loads((stories_dir / "GOLDEN.json").read_text())["greedy_ids_including_prompt"]
    device = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
    engine = Engine(
        str(stories_dir),
        max_total_tokens=2048,
        show_progress=False,
        log_level="warning",
        device=device,
    )
    try:
        runner = engine.runner
        runner.attention = TritonAttention(runner.kv_pool, runner.req_to_token)
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        out = engine.generate(input_ids=golden[:1], sampling_params=params)
        assert out["output_ids"] == golden[1:25]
        params["max_new_tokens"] = 8
        out = engine.generate(input_ids=golden[:20], sampling_params=params)
        assert out["meta_info"]["cached_tokens"] > 0  # the extend kernel ran over a prefix
        assert out["output_ids"] == golden[20:28]
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_qwen3_greedy_with_fused_layers(tmp_path):
    """Qwen3 through TritonAttention's fused layers: the q/k norms run the RMSNorm kernel over
    [tokens * heads, head_dim] rows before the one rotary pass; greedy tokens (fp32) equal
    transformers' on the same random weights, also past a prefix-cache hit."""
    from weft import Engine

    from hf_models import hf_greedy, save_random_model

    hf = save_random_model("qwen3-gqa-headdim-untied", tmp_path)
    device = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
    engine = Engine(
        str(tmp_path),
        dtype="float32",
        max_total_tokens=512,
        show_progress=False,
        log_level="warning",
        device=device,
    )
    try:
        runner = engine.runner
        runner.attention = TritonAttention(runner.kv_pool, runner.req_to_token)
        assert runner.attention.fused_layers
        params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        prompt = [3, 17, 42, 99, 5, 8, 120, 64, 11, 150]
        for ids in (prompt, [*prompt, 31, 7]):
            out = engine.generate(input_ids=ids, sampling_params=params)
            assert out["output_ids"] == hf_greedy(hf, ids, 6)
        assert out["meta_info"]["cached_tokens"] > 0
        engine.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_triton_matches_torch_real_shapes_cuda(request, mode):
    """Llama-3-8B attention (Hq=32, Hkv=8, D=128, bf16): 64 decodes up to 4096 long, or an
    extend step mixing long prefills, cached prefixes and decodes."""
    if mode == "decode":
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, 4096, (64,), generator=g).tolist()
        ext = [1] * 64
    else:
        prefix, ext = [0, 1000, 3000, 17, 2048], [2048, 512, 1096, 1, 1]
    dev = torch.device("cuda")
    _compare(request.node.nodeid, dev, torch.bfloat16, prefix, ext, 32, 8, 128)
