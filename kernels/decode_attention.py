"""Paged decode attention: one query token per request, split-K over the KV length.

Stage 1 (`_decode_split_kernel`), grid (B, Hkv, S): a program takes one request, one KV head with
all G = Hq / Hkv query heads that share it (one K/V read serves the group), and chunk s of the
S chunks of the request's KV positions. It writes the chunk's softmax-normalised output and its
log-sum-exp.
Stage 2 (`_decode_merge_kernel`), grid (B, Hq): combines the S partial results by their
log-sum-exp. Scores are kept in base 2 (exp2/log2) throughout; both stages agree on that.

Chunks of request b (`_split_bounds`; both stages compute them the same way), over the
kv_len = seq_len - lo positions the query sees (lo = 0 without a sliding window):

    chunk = ceil(ceil(kv_len / S) / BLOCK_N) * BLOCK_N     (whole tiles: only the last is partial)
    split s covers positions [lo + s * chunk, min(lo + (s + 1) * chunk, seq_len))  -- may be empty

An empty split writes nothing, and the merge skips it (it never reads its scratch rows).
The paged layout (page_size) is described in `_attn.py`.

Options, constexprs (each window or cap value compiles once; off, they leave no trace in the code):

    WINDOW > 0     a sliding window: the query (position seq_len - 1) sees keys at positions
                   [lo, seq_len) with lo = max(0, seq_len - WINDOW) (HF: q - k < window). The
                   splits cover those positions only: the pages before the window are never read.
                   WINDOW == 0: no window.
    LOGIT_CAP > 0  soft-capping: score = cap * tanh(score / cap) on the natural-base scores
                   (q.k * sm_scale), before the softmax (Gemma 2/3). 0.0: none.
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
def _split_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    if WINDOW > 0:
        # the splits share the window's kv_len positions [lo, seq_len) (HF: q - k < window)
        lo = tl.maximum(seq_len - WINDOW, 0)
        kv_len = seq_len - lo
        chunk = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, seq_len)
    else:
        chunk = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
    return start, end


# NOTE: the split count and the scratch strides that follow it are not specialized on (Triton
# would compile per value class: 1, multiple of 16, other): a mixed step sizes its splits from
# the step's contexts, and each new class compiled the kernels again in the middle of serving.
_SPLIT_ARGS = ["num_splits", "stride_mo_b", "stride_mo_h", "stride_ml_b", "stride_ml_h"]


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def _decode_split_kernel(
    q,  # [B, Hq, D]
    k_buf,  # [slots, Hkv, D]
    v_buf,
    req_to_token,  # [rows, max_ctx or max_pages]
    req_pool_indices,  # [B]
    seq_lens,  # [B]
    mid_o,  # [B, Hq, S, D] fp32
    mid_lse,  # [B, Hq, S] fp32, base 2
    qk_scale,  # sm_scale * k_scale * log2(e)
    v_scale,  # an FP8 pool's V scale (else 1.0)
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    start, end = _split_bounds(seq_len, split, num_splits, BLOCK_N, WINDOW)
    if start >= end:
        return
    row = tl.load(req_pool_indices + b).to(tl.int64)
    table_row = req_to_token + row * stride_table

    offs_h = tl.arange(0, BLOCK_H)  # rows >= GROUP are padding (tl.dot needs >= 16 rows)
    offs_d = tl.arange(0, BLOCK_D)  # cols >= HEAD_DIM are padding (BLOCK_D >= 16, power of 2)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # query heads h with h // GROUP == kv_head

    # padded rows/cols load as 0: their scores are 0 (finite), and they are never stored
    q_ptrs = q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BH, BD]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        slots = load_slots(table_row, pos, n_mask, PAGE_SIZE)  # [BN] int64
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = k_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        # NOTE: FP8 tiles widen to q's dtype here; their scales are in qk_scale and v_scale
        k_tile = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BN, BD]
        scores = dot(q_tile, tl.trans(k_tile), UPCAST, PRECISION) * qk_scale
        if LOGIT_CAP > 0:
            scores = softcap(scores, LOGIT_CAP)
        # every tile holds >= 1 position < end, so each row keeps a finite max
        scores = tl.where(n_mask[None, :], scores, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v_tile = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BN, BD]
        pv = dot(p.to(v_tile.dtype), v_tile, UPCAST, PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = h_mask[:, None] & d_mask[None, :]
    mo_ptrs = mid_o + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo_ptrs + offs_d[None, :], acc * (v_scale / l_i[:, None]), mask=out_mask)
    ml_ptrs = mid_lse + b * stride_ml_b + heads * stride_ml_h + split
    tl.store(ml_ptrs, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def _decode_merge_kernel(
    mid_o,  # [B, Hq, S, D] fp32
    mid_lse,  # [B, Hq, S] fp32
    out,  # [B, Hq, D]
    seq_lens,
    num_splits,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    start, end = _split_bounds(seq_len, offs_s, num_splits, BLOCK_N, WINDOW)
    # only splits that stage 1 wrote: in range and non-empty
    valid = (offs_s < num_splits) & (start < end)
    ml_ptrs = mid_lse + b * stride_ml_b + head * stride_ml_h + offs_s
    lse = tl.load(ml_ptrs, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)  # where(): lse - m is NaN when nothing is valid
    mo_ptrs = mid_o + b * stride_mo_b + head * stride_mo_h + offs_s[:, None] * stride_mo_s
    parts = tl.load(mo_ptrs + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # seq_len 0 -> 0
    o_ptrs = out + b * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, merged.to(out.dtype.element_ty), mask=d_mask)


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """Uninitialised fp32 scratch (a function so that tests can poison it)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def default_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Enough (request, KV head, split) programs to fill the GPU a few times over, with each split
    long enough (>= 256 positions) to amortise its merge."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = -(-4 * sms // max(batch_size * num_kv_heads, 1))
    longest = -(-max(max_seq_len, 1) // 256)
    return max(1, min(want, longest, 64))


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    page_size: int = 1,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 2,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged KV -> [B, Hq, D] in q's dtype.

    q [B, Hq, D] (head and token strides free), k_buffer/v_buffer [slots, Hkv, D] in q's dtype
    or float8_e4m3fn (an FP8 pool: they hold K / k_scale and V / v_scale),
    req_to_token [rows, cols] int32/int64, req_pool_indices [B], seq_lens [B] (>= 1; a request of
    length 0 gets zeros). Query head h reads KV head h // (Hq // Hkv) (as SDPA's enable_gqa).
    `sliding_window` W: the query sees only the last W positions (the others are not read);
    `logit_cap` c: scores become c * tanh(score / c) before the softmax. None: neither.
    `num_kv_splits` defaults to `default_num_kv_splits`, sized with `max_seq_len` (a host int: no
    device sync) when given. block_n, num_warps, num_stages: stage 1's tile and launch; the
    defaults won a sweep on an H100 (bench_kernels.py --sweep: 92-95% of copy bandwidth at
    B=64 L=4096 and B=256 L=1024, bf16, D=128); fp32 tiles are twice as large: 2 stages.
    """
    dev = q.device
    check_tensor("q", q, 3, FLOAT_DTYPES, dev)
    check_tensor("k_buffer", k_buffer, 3, (q.dtype, FP8_DTYPE), dev)
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), dev)
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, dev)
    check_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, dev)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, dev)
    batch, num_heads, head_dim = q.shape
    num_slots, num_kv_heads, _ = k_buffer.shape
    check_shape("k_buffer", k_buffer, (num_slots, num_kv_heads, head_dim))
    check_shape("v_buffer", v_buffer, (num_slots, num_kv_heads, head_dim))
    check_shape("req_pool_indices", req_pool_indices, (batch,))
    check_shape("seq_lens", seq_lens, (batch,))
    check(num_heads % num_kv_heads == 0, "Hq={} not a multiple of Hkv={}", num_heads, num_kv_heads)
    check(page_size >= 1, "page_size must be >= 1, got {}", page_size)
    check(block_n >= 16 and block_n == next_pow2(block_n), "bad block_n {}", block_n)
    window, cap = attention_options(sliding_window, logit_cap)
    out = check_out(out, (batch, num_heads, head_dim), q)
    if batch == 0:
        return out
    if num_kv_splits is None:
        longest = max_seq_len if max_seq_len is not None else req_to_token.shape[1] * page_size
        num_kv_splits = default_num_kv_splits(batch, num_kv_heads, longest, dev)
    check(num_kv_splits >= 1, "num_kv_splits must be >= 1, got {}", num_kv_splits)

    group = num_heads // num_kv_heads
    upcast, precision = dot_mode(q.dtype, dev)
    if num_stages is None:
        num_stages = 2 if q.dtype == torch.float32 else 3
    block_d = max(16, next_pow2(head_dim))
    # scratch: every (b, head, split) a non-empty split owns is written before the merge reads it
    # one allocation (host time: this runs per layer and step) holding two contiguous tensors
    num_o = batch * num_heads * num_kv_splits * head_dim
    scratch = _scratch(num_o + batch * num_heads * num_kv_splits, dev)
    mid_o = scratch[:num_o].view(batch, num_heads, num_kv_splits, head_dim)
    mid_lse = scratch[num_o:].view(batch, num_heads, num_kv_splits)
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale * k_scale * LOG2E,
        v_scale,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        UPCAST=upcast,
        PRECISION=precision,
        WINDOW=window,
        LOGIT_CAP=cap,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        seq_lens,
        num_kv_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=next_pow2(num_kv_splits),
        BLOCK_N=block_n,
        WINDOW=window,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    page_size: int = 1,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The torch twin: [B, Hq, D] in float32 (float64 for float64 inputs), one request at a time.

    It reads the whole context and masks the keys outside the window (the kernel skips them).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros((batch, num_heads, head_dim), dtype=dtype, device=q.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        slots = token_slots(req_to_token, int(req_pool_indices[b]), seq_len, page_size)
        keys = (k_buffer[slots].to(dtype) * k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = (v_buffer[slots].to(dtype) * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].to(dtype), keys) * sm_scale  # [Hq, L]
        if logit_cap is not None:
            scores = torch.tanh(scores / logit_cap) * logit_cap
        if sliding_window is not None:
            outside = torch.arange(seq_len, device=q.device) <= seq_len - 1 - sliding_window
            scores = scores.masked_fill(outside, float("-inf"))  # HF: visible iff q - k < W
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out
