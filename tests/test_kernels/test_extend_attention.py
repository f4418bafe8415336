"""Paged extend attention vs its torch twin (float64): prefixes, causal blocks, pages, GQA, sliding
windows and soft-capping."""

from __future__ import annotations

import math

import pytest
import torch

from weft.kernels.extend_attention import extend_attention, extend_attention_ref

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
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    index_dtype: torch.dtype = torch.int64,
) -> dict:
    g = generator(name, device)
    batch = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    cols = -(-(max(seq_lens) + 3) // page_size)
    rows = 2 * batch + 1
    num_entries = rows * cols + 8
    k_buf = randn((num_entries * page_size, num_kv_heads, head_dim), dtype, device, g)
    v_buf = randn((num_entries * page_size, num_kv_heads, head_dim), dtype, device, g)
    k_buf[:page_size] = 0
    v_buf[:page_size] = 0
    table = random_table(rows, cols, num_entries, index_dtype, device, g)
    row_ids = torch.randperm(rows, generator=g, device=device)[:batch].to(index_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype, device=device)
    poison_unused(k_buf, table, row_ids, lens, page_size)
    poison_unused(v_buf, table, row_ids, lens, page_size)
    qo_indptr = torch.zeros(batch + 1, dtype=index_dtype, device=device)
    qo_indptr[1:] = torch.tensor(extend_lens, device=device).cumsum(0)
    q = randn((sum(extend_lens), num_heads, head_dim), dtype, device, g)
    return dict(
        q=q,
        k_buffer=k_buf,
        v_buffer=v_buf,
        req_to_token=table,
        req_pool_indices=row_ids,
        qo_indptr=qo_indptr,
        prefix_lens=torch.tensor(prefix_lens, dtype=index_dtype, device=device),
        sm_scale=1.0 / math.sqrt(head_dim),
        page_size=page_size,
    )


def _check(
    args: dict,
    dtype: torch.dtype,
    max_extend_len: int,
    *,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    **kwargs: object,
) -> None:
    q = args["q"]
    as64 = {k: (v.double() if k in ("q", "k_buffer", "v_buffer") else v) for k, v in args.items()}
    scales = {k: kwargs[k] for k in ("k_scale", "v_scale") if k in kwargs}
    ref = extend_attention_ref(**as64, sliding_window=sliding_window, logit_cap=logit_cap, **scales)  # type: ignore[arg-type]
    if sliding_window is not None:
        # keys before the first new token's window are outside every query's: never read
        starts = (args["prefix_lens"] - sliding_window + 1).clamp(min=0)
        for buf in (args["k_buffer"], args["v_buffer"]):
            poison_before(
                buf, args["req_to_token"], args["req_pool_indices"], starts, args["page_size"]
            )
    out = poisoned(tuple(q.shape), q.dtype, q.device)
    result = extend_attention(
        **args,
        max_extend_len=max_extend_len,
        out=out,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        **kwargs,
    )
    assert result is out
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_dtypes_and_pages(request, dtype, page_size):
    """No prefix; a prefix with several query blocks; one new token (a decode in a mixed batch)."""
    prefix, ext = [0, 13, 21], [7, 20, 1]
    args = _case(request.node.nodeid, SMALL_DEVICE, dtype, prefix, ext, 4, 2, 32, page_size)
    _check(args, dtype, max(ext), block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_fp8_pool(request, dtype):
    """An FP8 pool: the kernel widens each tile and applies the layer's scales."""
    prefix, ext = [0, 13, 21], [7, 20, 1]
    args = _case(request.node.nodeid, SMALL_DEVICE, dtype, prefix, ext, 4, 2, 32, 1)
    _check(
        fp8_pool(args, 0.25, 3.0),
        dtype,
        max(ext),
        block_m=16,
        block_n=16,
        k_scale=0.25,
        v_scale=3.0,
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(2, 2, 16), (8, 2, 16), (4, 1, 64), (4, 2, 8), (6, 3, 24)],
)
def test_extend_head_layouts(request, num_heads, num_kv_heads, head_dim):
    prefix, ext = [5, 0], [11, 17]
    args = _case(
        request.node.nodeid,
        SMALL_DEVICE,
        torch.float32,
        prefix,
        ext,
        num_heads,
        num_kv_heads,
        head_dim,
        1,
    )
    _check(args, torch.float32, max(ext), block_m=16, block_n=16)


def test_extend_default_blocks_int32_strided_q(request):
    """Default tiles; q a head slice of a fused [T, Hq + Hkv, D] tensor."""
    prefix, ext = [30, 0, 2], [9, 33, 40]
    args = _case(
        request.node.nodeid, SMALL_DEVICE, torch.bfloat16, prefix, ext, 4, 2, 32, 1, torch.int32
    )
    wide = randn((82, 6, 32), torch.bfloat16, SMALL_DEVICE, generator("wide", SMALL_DEVICE))
    wide[:, :4] = args["q"]
    args["q"] = wide[:, :4]
    _check(args, torch.bfloat16, max(ext))


def test_extend_grid_larger_than_needed(request):
    """max_extend_len is an upper bound: extra query blocks must do nothing."""
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, [3], [5], 2, 1, 16, 1)
    _check(args, torch.float32, 40, block_m=16, block_n=16)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("window", "cap"),
    [(5, None), (16, None), (1, None), (100, None), (None, 2.5), (7, 30.0)],
    ids=["w5", "w16", "w1", "w100-longer", "cap2.5", "w7-cap30"],
)
def test_extend_window_and_softcap(request, page_size, window, cap):
    """Sliding windows shorter and longer than prefixes and query blocks (rows that see nothing
    in a block's first key tiles), cached prefixes whose early keys are NaN (skipped), one-token
    extends; and logit soft-capping."""
    prefix, ext = [0, 12, 40, 3, 25], [37, 20, 1, 5, 40]
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, prefix, ext, 4, 2, 16, page_size)
    _check(
        args, torch.float32, max(ext), sliding_window=window, logit_cap=cap, block_m=16, block_n=16
    )


def test_extend_window_wider_query_block_bf16(request):
    """BLOCK_M 32 > BLOCK_N 16 with a window of 4: rows past the first key tile see none of it."""
    prefix, ext = [9, 0], [40, 33]
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.bfloat16, prefix, ext, 2, 1, 32, 1)
    _check(args, torch.bfloat16, 40, sliding_window=4, logit_cap=10.0, block_m=32, block_n=16)


def test_extend_rejects_bad_inputs(request):
    args = _case(request.node.nodeid, SMALL_DEVICE, torch.float32, [3, 0], [2, 4], 4, 2, 16, 1)
    with pytest.raises(ValueError, match="qo_indptr"):
        extend_attention(**{**args, "qo_indptr": args["qo_indptr"][:2]}, max_extend_len=4)
    with pytest.raises(ValueError, match="block_m"):
        extend_attention(**args, max_extend_len=4, block_m=24)
    with pytest.raises(ValueError, match="dtype"):
        extend_attention(**{**args, "v_buffer": args["v_buffer"].double()}, max_extend_len=4)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_real_shapes_cuda(request, page_size):
    """Llama-3-8B shapes, bf16: prefills with and without cached prefixes, up to 4096 tokens."""
    dev = torch.device("cuda")
    prefix = [0, 1000, 3000, 17, 0, 2048]
    ext = [4096, 512, 1096, 1, 300, 2048]
    args = _case(request.node.nodeid, dev, torch.bfloat16, prefix, ext, 32, 8, 128, page_size)
    _check(args, torch.bfloat16, max(ext))


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.float32, 128), (torch.float16, 128), (torch.bfloat16, 256), (torch.float32, 64)],
)
def test_extend_dtypes_head_dims_cuda(request, dtype, head_dim):
    """The other default tile configurations compile (shared memory) and are right."""
    prefix, ext = [0, 300, 77], [700, 129, 1]
    args = _case(request.node.nodeid, torch.device("cuda"), dtype, prefix, ext, 16, 4, head_dim, 1)
    _check(args, dtype, max(ext))
