"""Paged extend (prefill) attention: new tokens of each request over its cached prefix + themselves.

Grid (B, Hq, ceil(max_extend_len / BLOCK_M)): a program takes BLOCK_M new query tokens of one
request and one query head, and streams the request's keys from the pool, whose first seq_len
slots hold the prefix and (already stored) the new tokens:

    query t (0 <= t < ext) of request b: row qo_indptr[b] + t of q, absolute position prefix + t
    key   j (0 <= j < seq_len = prefix + ext): visible to query t  iff  j <= prefix + t

So the prefix is visible to every new token and the new tokens attend causally. The key loop of
a query block [m0, m0 + BLOCK_M) stops at min(seq_len, prefix + m0 + BLOCK_M), the last key any
of its queries sees. The paged layout (page_size) is described in `_attn.py`.

Options, constexprs as in decode_attention.py (off, they leave no trace in the code):

    WINDOW > 0     a sliding window: key j is visible to query t iff also
                   (prefix + t) - j < WINDOW (HF's convention); the key loop of a query block
                   starts at max(0, prefix + m0 - WINDOW + 1), the first key its first query sees.
    LOGIT_CAP > 0  soft-capping of the natural-base scores before the softmax: cap * tanh(s / cap).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._attn import LOG2E, attention_options, dot, load_slots, softcap, token_slots
from weft.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_out,
    check_shape,
    check_tensor,
    dot_mode,
    next_pow2,
)
from weft.runtime.models.fp8 import FP8_DTYPE


@triton.jit
def _extend_kernel(
    q,  # [T, Hq, D]
    k_buf,  # [slots, Hkv, D]
    v_buf,
    out,  # [T, Hq, D]
    req_to_token,  # [rows, max_ctx or max_pages]
    req_pool_indices,  # [B]
    qo_indptr,  # [B + 1]: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1
    prefix_lens,  # [B]
    qk_scale,  # sm_scale * k_scale * log2(e): scores are kept in base 2
    v_scale,  # an FP8 pool's V scale (else 1.0)
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(qo_indptr + b).to(tl.int64)
    ext = (tl.load(qo_indptr + b + 1) - q_start).to(tl.int32)
    if m0 >= ext:
        return  # the grid is sized for the longest request
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    seq_len = prefix + ext
    row = tl.load(req_pool_indices + b).to(tl.int64)
    table_row = req_to_token + row * stride_table
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)  # query index t within the request
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)  # cols >= HEAD_DIM are padding (BLOCK_D >= 16, power of 2)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # absolute positions of the queries
    q_rows = q_start + offs_m
    q_ptrs = q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BM, BD]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
    if WINDOW > 0:
        lo = tl.maximum(prefix + m0 - WINDOW + 1, 0)  # keys before lo are outside every window
    else:
        lo = 0
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + offs_n  # absolute key positions
        n_mask = pos < end
        slots = load_slots(table_row, pos, n_mask, PAGE_SIZE)  # [BN] int64
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = k_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        # NOTE: FP8 tiles widen to q's dtype here; their scales are in qk_scale and v_scale
        k_tile = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BN, BD]
        scores = dot(q_tile, tl.trans(k_tile), UPCAST, PRECISION) * qk_scale  # [BM, BN]
        if LOGIT_CAP > 0:
            scores = softcap(scores, LOGIT_CAP)
        # NOTE: key 0 is visible to every query and lies in the first tile, so after it each row
        # has a finite running max and fully masked later tiles contribute exp2(-inf) = 0.
        # Padded query rows (t >= ext) have q_pos >= seq_len: they see every key, stay finite,
        # and are never stored.
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        if WINDOW > 0:
            # NOTE: with a window a row may see nothing in the first tiles (its first key lies
            # later) or at all (padded rows): an all -inf row shifts by 0, so that its exp2 terms
            # are 0 instead of exp2(-inf - -inf) = NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v_tile = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BN, BD]
        acc = acc * alpha[:, None] + dot(p.to(v_tile.dtype), v_tile, UPCAST, PRECISION)
        m_i = m_new

    o_ptrs = out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    if WINDOW > 0:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # padded rows (never stored) may have seen no key
    o_tile = acc * (v_scale / l_i[:, None])
    tl.store(o_ptrs, o_tile.to(out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _default_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_stages). 16-bit rows of <= 256 bytes: 128 x 64 tiles, 3 stages, the
    best of a sweep on an H100 (bench_kernels.py --sweep: ~300 TFLOP/s, 4 x 4096 causal, bf16,
    D=128); wider rows (fp32, D > 128) get smaller tiles so that the stages fit shared memory."""
    if dtype.itemsize * max(16, next_pow2(head_dim)) <= 256:
        return 128, 64, 3
    return 64, 32, 2


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    page_size: int = 1,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of the new tokens of each request -> [T, Hq, D] in q's dtype.

    q [T, Hq, D] (token and head strides free; request b's tokens are rows qo_indptr[b] ..
    qo_indptr[b+1]-1), k_buffer/v_buffer [slots, Hkv, D] holding the new tokens' K/V already
    (q's dtype, or float8_e4m3fn holding K / k_scale and V / v_scale),
    req_to_token [rows, cols], req_pool_indices [B], qo_indptr [B + 1], prefix_lens [B] (all
    int32/int64). `max_extend_len` (a host int, >= every extend length) sizes the grid.
    Query head h reads KV head h // (Hq // Hkv). `sliding_window` W: a query at position p sees
    keys in (p - W, p] (earlier key tiles are not read); `logit_cap` c: scores become
    c * tanh(score / c) before the softmax; None: neither. block_m, block_n, num_warps,
    num_stages: the tiles and launch; unset, `_default_tiles` picks them.
    """
    dev = q.device
    check_tensor("q", q, 3, FLOAT_DTYPES, dev)
    check_tensor("k_buffer", k_buffer, 3, (q.dtype, FP8_DTYPE), dev)
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), dev)
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, dev)
    check_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, dev)
    check_tensor("qo_indptr", qo_indptr, 1, INDEX_DTYPES, dev)
    check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES, dev)
    num_tokens, num_heads, head_dim = q.shape
    num_slots, num_kv_heads, _ = k_buffer.shape
    batch = req_pool_indices.shape[0]
    check_shape("k_buffer", k_buffer, (num_slots, num_kv_heads, head_dim))
    check_shape("v_buffer", v_buffer, (num_slots, num_kv_heads, head_dim))
    check_shape("qo_indptr", qo_indptr, (batch + 1,))
    check_shape("prefix_lens", prefix_lens, (batch,))
    check(num_heads % num_kv_heads == 0, "Hq={} not a multiple of Hkv={}", num_heads, num_kv_heads)
    check(page_size >= 1, "page_size must be >= 1, got {}", page_size)
    check(max_extend_len >= 0, "max_extend_len must be >= 0, got {}", max_extend_len)
    window, cap = attention_options(sliding_window, logit_cap)
    default_m, default_n, default_stages = _default_tiles(q.dtype, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    num_stages = num_stages or default_stages
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        check(blk >= 16 and blk == next_pow2(blk), "bad {} {}", name, blk)
    out = check_out(out, (num_tokens, num_heads, head_dim), q)
    if batch == 0 or max_extend_len == 0:
        return out

    upcast, precision = dot_mode(q.dtype, dev)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        qo_indptr,
        prefix_lens,
        sm_scale * k_scale * LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE_SIZE=page_size,
        UPCAST=upcast,
        PRECISION=precision,
        WINDOW=window,
        LOGIT_CAP=cap,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
    *,
    page_size: int = 1,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The torch twin: [T, Hq, D] in float32 (float64 for float64 inputs), one request at a time."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=dtype, device=q.device)
    for b in range(req_pool_indices.shape[0]):
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        prefix = int(prefix_lens[b])
        seq_len = prefix + stop - start
        slots = token_slots(req_to_token, int(req_pool_indices[b]), seq_len, page_size)
        keys = (k_buffer[slots].to(dtype) * k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = (v_buffer[slots].to(dtype) * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:stop].to(dtype), keys) * sm_scale
        if logit_cap is not None:
            scores = torch.tanh(scores / logit_cap) * logit_cap
        q_pos = torch.arange(prefix, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos  # [ext, L]
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:stop] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
    return out
