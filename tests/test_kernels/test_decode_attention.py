"""Paged decode attention vs its torch twin (float64): page sizes, GQA, splits, strides, sliding
windows and soft-capping."""

from __future__ import annotations

import math

import pytest
import torch

from weft.kernels import decode_attention as mod
from weft.kernels.decode_attention import decode_attention, decode_attention_ref

from .kernel_utils import (
    REL_TOL,
    SMALL_DEVICE,
    fp8_pool,
    generator,
    poison_before,
    poison_unused,
    poisoned,
    randn,
    random_table,
    rel_err,
)


def _case(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    index_dtype: torch.dtype = torch.int64,
    max_ctx: int | None = None,
) -> dict:
    """Random pool and table; the table's rows are a shuffled subset, with spare rows between."""
    g = generator(name, device)
    batch = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens) + 3
    cols = -(-max_ctx // page_size)
    rows = 2 * batch + 1
    num_entries = rows * cols + 8  # slots (page 1) or pages, 0 reserved
    k_buf = randn((num_entries * page_size, num_kv_heads, head_dim), dtype, device, g)
    v_buf = randn((num_entries * page_size, num_kv_heads, head_dim), dtype, device, g)
    k_buf[:page_size] = 0  # the reserved slot / page stays zero, as in the KVPool
    v_buf[:page_size] = 0
    table = random_table(rows, cols, num_entries, index_dtype, device, g)
    row_ids = torch.randperm(rows, generator=g, device=device)[:batch].to(index_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype, device=device)
    poison_unused(k_buf, table, row_ids, lens, page_size)
    q = randn((batch, num_heads, head_dim), dtype, device, g)
    return dict(
        q=q,
        k_buffer=k_buf,
        v_buffer=v_buf,
        req_to_token=table,
        req_pool_indices=row_ids,
        seq_lens=lens,
        sm_scale=1.0 / math.sqrt(head_dim),
        page_size=page_size,
    )


def _check(
    args: dict,
    dtype: torch.dtype,
    *,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    **kwargs: object,
) -> None:
    q = args["q"]
    as64 = {k: (v.double() if k in ("q", "k_buffer", "v_buffer") else v) for k, v in args.items()}
    # the reference reads only positions < seq_len too, so it must not see the NaNs either
    scales = {k: kwargs[k] for k in ("k_scale", "v_scale") if k in kwargs}
    ref = decode_attention_ref(**as64, sliding_window=sliding_window, logit_cap=logit_cap, **scales)  # type: ignore[arg-type]
    if sliding_window is not None:  # the kernel must not even read the keys before the window
        starts = (args["seq_lens"] - sliding_window).clamp(min=0)
        for buf in (args["k_buffer"], args["v_buffer"]):
            poison_before(
                buf, args["req_to_token"], args["req_pool_indices"], starts, args["page_size"]
            )
    out = poisoned(tuple(q.shape), q.dtype, q.device)
    result = decode_attention(
        **args, out=out, sliding_window=sliding_window, logit_cap=logit_cap, **kwargs
    )
    assert result is out
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_dtypes_and_pages(request, dtype, page_size):
    args = _case(request.node.nodeid, SMALL_DEVICE, dtype, [1, 37, 20], 4, 2, 32, page_size)
    _check(args, dtype, num_kv_splits=3, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_fp8_pool(request, dtype, page_size):
    """An FP8 pool: the kernel widens each tile and applies the layer's scales (against the
    reference on the same e4m3 values)."""
    args = _case(request.node.nodeid, SMALL_DEVICE, dtype, [1, 37, 20], 4, 2, 32, page_size)
    _check(fp8_pool(args, 0.25, 3.0), dtype, num_kv_splits=3, block_n=16, k_scale=0.25, v_scale=3.0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(2, 2, 16), (8, 2, 16), (4, 1, 64), (4, 2, 8), (6, 3, 24)],
)
def test_decode_head_layouts(request, num_heads, num_kv_heads, head_dim):
    """MHA, GQA groups 4 and 4 (MQA), head dims below 16 and not powers of two (padded)."""
    args = _case(
        request.node.nodeid,
        SMALL_DEVICE,
        torch.float32,
        [5, 23],
        num_heads,
        num_kv_heads,
        head_dim,
        1,
    )
    _check(args, torch.float32, num_kv_splits=2, block_n=16)


@pytest.mark.parametrize("num_kv_splits", [1, 2, 7, None])
def test_decode_splits(request, num_kv_splits):
    """More splits than tiles (empty splits), one split, and the default heuristic."""
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, [40, 3, 17], 4, 2, 16, 1)
    _check(args, torch.float32, num_kv_splits=num_kv_splits, block_n=16, max_seq_len=40)


def test_decode_int32_indices_strided_q_default_blocks(request):
    args = _case(
        request.node.nodeid, SMALL_DEVICE, torch.bfloat16, [33, 9], 4, 2, 32, 1, torch.int32
    )
    # q as the decode step produces it: a head slice of a wider [B, Hq + Hkv, D] tensor
    wide = randn((2, 6, 32), torch.bfloat16, SMALL_DEVICE, generator("wide", SMALL_DEVICE))
    wide[:, :4] = args["q"]
    args["q"] = wide[:, :4]
    assert not args["q"].is_contiguous()
    _check(args, torch.bfloat16, num_kv_splits=2)


def test_decode_merge_reads_only_written_splits(request, monkeypatch):
    """Scratch rows of empty splits stay NaN: the merge must skip them."""
    real = mod._scratch
    monkeypatch.setattr(mod, "_scratch", lambda numel, device: real(numel, device).fill_(math.nan))
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, [2, 18], 2, 1, 16, 1)
    _check(args, torch.float32, num_kv_splits=4, block_n=16)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("window", "cap"),
    [(5, None), (16, None), (1, None), (100, None), (None, 2.5), (7, 30.0)],
    ids=["w5", "w16", "w1", "w100-longer", "cap2.5", "w7-cap30"],
)
def test_decode_window_and_softcap(request, page_size, window, cap):
    """Sliding windows shorter and longer than the contexts (the keys before a window are NaN:
    they are skipped) and logit soft-capping, over several splits and pages."""
    lens = [1, 37, 20, 6, 64]
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, lens, 4, 2, 16, page_size)
    _check(args, torch.float32, sliding_window=window, logit_cap=cap, num_kv_splits=3, block_n=16)


def test_decode_window_bf16_default_splits(request):
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.bfloat16, [70, 9, 33], 8, 2, 32, 1)
    _check(args, torch.bfloat16, sliding_window=24, logit_cap=20.0, max_seq_len=70)


def test_decode_rejects_bad_inputs(request):
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, [4], 4, 2, 16, 1)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(**{**args, "q": args["q"][:, :3]})
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(**{**args, "q": args["q"].half()})
    with pytest.raises(ValueError, match="stride"):
        decode_attention(**{**args, "k_buffer": args["k_buffer"].transpose(1, 2)})
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(**{**args, "seq_lens": args["seq_lens"].repeat(2)})
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(**args, sliding_window=0)
    with pytest.raises(ValueError, match="logit_cap"):
        decode_attention(**args, logit_cap=-1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_real_shapes_cuda(request, page_size):
    """Llama-3-8B attention shapes: B=64, contexts up to 4096, Hq=32, Hkv=8, D=128, bf16."""
    dev = torch.device("cuda")
    g = generator(request.node.nodeid, torch.device("cpu"))
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    lens[0] = 4096
    args = _case(
        request.node.nodeid, dev, torch.bfloat16, lens, 32, 8, 128, page_size, max_ctx=4096
    )
    _check(args, torch.bfloat16, max_seq_len=max(lens))


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.float32, 128), (torch.float16, 128), (torch.bfloat16, 256), (torch.float32, 64)],
)
def test_decode_dtypes_head_dims_cuda(request, dtype, head_dim):
    lens = [1, 700, 2000, 63]
    args = _case(request.node.nodeid, torch.device("cuda"), dtype, lens, 16, 4, head_dim, 1)
    _check(args, dtype, max_seq_len=max(lens))
