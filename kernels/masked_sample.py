"""Grammar-constrained sampling in one kernel: token bitmask, temperature, top-k/top-p/min-p and
the draw, one program per row, no [B, V] intermediate.

Row b, with l = logits[b] and A = its allowed tokens (all of them; for a constrained row, the
tokens t < V whose bit t % 32 of bitmask[b, t // 32] is set, none at or past 32 * W):

    A empty (constrained)     -> id -1 (logprob NaN): the caller's error, never a garbage token
    greedy: temperature < 1e-5 or top_k == 1
                              -> argmax of l over A, the smallest id on ties
    sampled, over A:  e_i = exp((l_i - max_A l) / temperature)     (p_i = e_i / Z, Z = sum_A e)
        top-k   keep  l_i >= the k-th largest l over A             k <= 0 or k >= |A|: off
        top-p   keep  sum of e_j over l_j > l_i  <  top_p * Z      top_p >= 1: off
        min-p   keep  e_i >= min_p          (i.e. p_i >= min_p * max p; 0: off)
        kept = A ∩ the three; K = sum of e over kept
        -> the first kept token, in id order, whose running sum of e exceeds uniform * K
           (none, by rounding with uniform close to 1: the last kept token with e > 0)
    logprob: log_softmax(l)[id], the model's raw distribution (no mask, no temperature)

NOTE (ties): every filter is a threshold on the token's own value, so tokens tied with the last
one kept are all kept (top-k may keep more than k). "More probable" compares raw logits, which
order the probabilities the same way (dividing by the temperature could round two different
logits to one probability; we never look at that rounding).
NOTE: a sampled row whose kept set has no mass (all allowed logits -inf; min_p > 1) gets its
greedy token. Logits must be finite or -inf: +inf and NaN give unspecified tokens, but never an
out-of-range id or an out-of-bounds read.

Layout. A row is CHUNKS contiguous chunks of `chunk_words` bitmask words (32 tokens each); a
tile is one word of every chunk, [CHUNKS, 32], and a pass walks the chunk_words tiles. Each
chunk reads its own bitmask word once per tile and expands it with shifts. Accumulators are
per tile element or per chunk and reduced across warps once per pass, not per tile (a pass is
bound by load latency: one program, one SM, per row).

Passes over the row (greedy and empty rows stop after the first):

    1  max, argmax, count over A (per chunk); the raw max / sum for the logprob
    2  only with top-k or top-p: the search for theta = max(theta_k, theta_p), below
    3  compaction of the search's candidates, in id order, into a per-row buffer of CAP
       (offsets from per-chunk counts), where theta is exact (tl.sort)
    4  the draw: over the buffer when it holds every token above the cut, else over the row:
       kept mass per chunk, then a tl.cumsum scan of the chunk where uniform * K falls

The search. A token survives top-k and top-p iff its logit >= theta, the smallest value c at
which G(c) fails, G(c) = "count of l > c >= k (top-k on) or mass of l > c >= top_p * Z (top-p
on)". G only changes at data values. Each pass evaluates NUM_CAND cuts (count and mass above
each, per chunk) and keeps lo < theta <= hi, G(lo) true and G(hi) false: the first pass cuts
at 1 .. 32 halvings of probability below the max; later ones aim at even shares of the tokens
in (lo, hi] (by the log of the count, linear in the logit, as in a tail), one cut halving
(lo, hi) in the integer keys of float32 (`_key`, order-preserving), which bounds the passes by
~32. It stops as soon as the CAP buffer can hold the tokens above lo (then theta and the draw
come from the buffer alone: the mass above any of them is there) or those in (lo, hi] (theta
from the buffer plus the count and mass above hi; the draw over the row); or when hi == lo + 1
(theta = hi: a tie group larger than CAP).
Kernel and twin agree exactly except where a float sum is within rounding of a boundary (top-p
mass, min-p ratio, the draw): the kernel sums per chunk and in tl.cumsum's order, the twin in
vocabulary order.
NOTE: software pipelining of the tile loads (tl.range num_stages) measured slower on an H100.
"""

from __future__ import annotations

import importlib.util

import torch

from weft.kernels._checks import INDEX_DTYPES, check, check_shape, check_tensor, next_pow2
from weft.runtime.sampling_params import GREEDY_TEMPERATURE

HAS_TRITON = importlib.util.find_spec("triton") is not None

LOG2E = 1.4426950408889634

if HAS_TRITON:  # NOTE: the torch twin (the CPU path) must import where Triton is not installed
    import triton
    import triton.language as tl

    from weft.kernels._sample_passes import (
        _buffer_mass,
        _buffer_theta,
        _compact,
        _draw_buffer,
        _draw_chunks,
        _load_words,
        _search,
        _unkey,
    )

    # NOTE: a @triton.jit function reads only constexpr globals
    _LOG2E = tl.constexpr(LOG2E)
    _GREEDY_TEMPERATURE = tl.constexpr(GREEDY_TEMPERATURE)

    @triton.jit
    def _masked_sample_kernel(
        logits,  # [B, V] fp32
        bitmask,  # [B, W] int32 (unused without HAS_MASK)
        constrained,  # [B] uint8 (unused without HAS_CONSTRAINED)
        temperature,  # [B] fp32
        top_k,  # [B] int32/int64
        top_p,  # [B] fp32
        min_p,  # [B] fp32
        uniform,  # [B] fp32
        buf_v,  # [B, CAP] fp32 scratch
        buf_i,  # [B, CAP] int32 scratch
        out_ids,  # [B] int64
        out_logprobs,  # [B] fp32 (unused without WANT_LOGPROBS)
        vocab,
        num_words,
        chunk_words,
        stride_l,
        stride_m,
        HAS_MASK: tl.constexpr,
        HAS_CONSTRAINED: tl.constexpr,
        WANT_LOGPROBS: tl.constexpr,
        CHUNKS: tl.constexpr,
        CHUNK_WORDS: tl.constexpr,  # next_pow2(chunk_words)
        NUM_CAND: tl.constexpr,
        CAP: tl.constexpr,
        MAX_PASSES: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        l_row = logits + row * stride_l
        m_row = bitmask + row * stride_m
        if HAS_CONSTRAINED:
            is_constrained = tl.load(constrained + row) != 0
        else:
            is_constrained = tl.full([], 1, tl.int1)
        t = tl.load(temperature + row)
        k = tl.load(top_k + row).to(tl.int32)
        greedy = (t < _GREEDY_TEMPERATURE) | (k == 1)
        # exp as exp2; greedy rows use 1 (no overflow, no division by 0)
        scale = (1.0 / tl.where(greedy, 1.0, t)) * _LOG2E

        # pass 1, per tile element: max and first argmax over A (lm: -inf outside A), count
        chunk = tl.arange(0, CHUNKS)
        lane = tl.arange(0, 32)[None, :]
        words_v = (vocab + 31) // 32
        acc_max = tl.full([CHUNKS, 32], float("-inf"), tl.float32)
        acc_arg = tl.full([CHUNKS, 32], 0, tl.int32) + vocab  # vocab: none yet
        acc_count = tl.zeros([CHUNKS, 32], dtype=tl.int32)
        raw_max = tl.full([CHUNKS, 32], float("-inf"), tl.float32)
        raw_sum = tl.zeros([CHUNKS, 32], dtype=tl.float32)
        for i in range(0, chunk_words):
            word = (chunk * chunk_words + i)[:, None]
            tok, logit, allowed = _load_words(
                l_row, m_row, word, lane, word < words_v, vocab, num_words, is_constrained, HAS_MASK
            )
            lm = tl.where(allowed, logit, float("-inf"))
            # ids grow along a lane: ties keep the earlier; an all -inf lane keeps its first
            take = (lm > acc_max) | (allowed & (acc_arg == vocab))
            acc_arg = tl.where(take, tok, acc_arg)
            acc_max = tl.maximum(acc_max, lm)
            acc_count += allowed.to(tl.int32)
            if WANT_LOGPROBS:
                new_max = tl.maximum(raw_max, logit)
                safe = tl.where(new_max == float("-inf"), 0.0, new_max)
                raw_sum = raw_sum * tl.exp2((raw_max - safe) * _LOG2E) + tl.exp2(
                    (logit - safe) * _LOG2E
                )
                raw_max = new_max
        row_max = tl.max(acc_max)
        arg = tl.min(tl.where((acc_max == row_max) & (acc_arg < vocab), acc_arg, vocab))
        arg = tl.where(arg < vocab, arg, tl.min(acc_arg))  # NaN logits: still an allowed id
        chunk_allowed = tl.sum(acc_count, 1)
        n_allowed = tl.sum(chunk_allowed)

        chosen = arg
        if n_allowed == 0:
            chosen = tl.full([], -1, tl.int32)
        elif (greedy == 0) & (row_max > float("-inf")):
            p = tl.load(top_p + row)
            mp = tl.load(min_p + row)
            u = tl.load(uniform + row)
            bv, bi = buf_v + row * CAP, buf_i + row * CAP  # the row's buffer: values, ids
            need_k = (k > 0) & (k < n_allowed)
            need_p = p < 1.0
            theta = tl.full([], float("-inf"), tl.float32)
            n_lo = n_allowed
            in_buffer = tl.zeros([], dtype=tl.int1)  # the draw: over the buffer, or by chunks
            if need_k | need_p:
                lo, hi, n_lo, n_hi, m_hi, chunk_lo, chunk_hi, z = _search(
                    l_row,
                    m_row,
                    vocab,
                    chunk_words,
                    num_words,
                    is_constrained,
                    row_max,
                    scale,
                    k,
                    need_k,
                    p,
                    need_p,
                    n_allowed,
                    chunk_allowed,
                    HAS_MASK,
                    CHUNKS,
                    NUM_CAND,
                    CAP,
                    MAX_PASSES,
                )
                theta = _unkey(hi)
                # the buffer: every token above lo (then the draw too), else those in (lo, hi]
                in_buffer = n_lo <= CAP
                n_buf = tl.where(in_buffer, n_lo, n_lo - n_hi)
                if n_buf <= CAP:
                    lower = _unkey(tl.maximum(lo + 1, -0x7F800000))  # l > lo <=> l >= next
                    upper = tl.where(in_buffer, float("inf"), theta)
                    _compact(
                        l_row,
                        m_row,
                        bv,
                        bi,
                        vocab,
                        chunk_words,
                        num_words,
                        is_constrained,
                        lower,
                        upper,
                        tl.where(in_buffer, chunk_lo, chunk_lo - chunk_hi),
                        HAS_MASK,
                        CHUNKS,
                        CAP,
                    )
                    tl.debug_barrier()  # the buffer's writes, visible to every thread
                    if z < 0:  # no search pass: the buffer holds all of A
                        z = _buffer_mass(bv, n_buf, row_max, scale, CAP)
                    n_above = tl.where(in_buffer, 0, n_hi)  # tokens above the buffered ones
                    m_above = tl.where(in_buffer, 0.0, m_hi)
                    theta_buf = _buffer_theta(
                        bv, n_buf, row_max, scale, z, n_above, m_above, k, need_k, p, need_p, CAP
                    )
                    # no token in (lo, hi]: any value there keeps the same set
                    theta = tl.where(n_buf > 0, theta_buf, theta)
            if in_buffer:
                chosen = _draw_buffer(bv, bi, n_lo, row_max, scale, theta, mp, u, CAP)
            else:
                chosen = _draw_chunks(
                    l_row,
                    m_row,
                    vocab,
                    chunk_words,
                    num_words,
                    is_constrained,
                    row_max,
                    scale,
                    theta,
                    mp,
                    u,
                    HAS_MASK,
                    CHUNKS,
                    CHUNK_WORDS,
                )
            chosen = tl.where(chosen >= 0, chosen, arg)  # no kept mass: the greedy token
        tl.store(out_ids + row, chosen.to(tl.int64))
        if WANT_LOGPROBS:
            top = tl.max(raw_max)
            total = tl.sum(raw_sum * tl.exp2((raw_max - top) * _LOG2E))
            picked = tl.load(l_row + tl.maximum(chosen, 0))
            logprob = (picked - top) - tl.log(total)
            tl.store(out_logprobs + row, tl.where(chosen >= 0, logprob, float("nan")))


def check_args(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    constrained: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[int, int]:
    """(B, V) after the metadata checks both paths share."""
    dev = logits.device
    check_tensor("logits", logits, 2, (torch.float32,), dev)
    batch, vocab = logits.shape
    check(vocab >= 1, "logits: empty vocabulary")
    if bitmask is not None:
        check_tensor("bitmask", bitmask, 2, (torch.int32,), dev)
        rows = bitmask.shape[0]
        check(rows == batch, "bitmask: {} rows for {} logits rows", rows, batch)
    if constrained is not None:
        check(bitmask is not None, "constrained rows given without a bitmask")
        check_tensor("constrained", constrained, 1, (torch.bool,), dev)
        check_shape("constrained", constrained, (batch,))
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, INDEX_DTYPES),
        ("top_p", top_p, (torch.float32,)),
        ("min_p", min_p, (torch.float32,)),
        ("uniform", uniform, (torch.float32,)),
    ):
        check_tensor(name, t, 1, dtypes, dev)
        check_shape(name, t, (batch,))
    return batch, vocab


def masked_sample(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    constrained: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    want_logprobs: bool = False,
    *,
    chunks: int | None = None,
    num_candidates: int = 4,
    capacity: int = 2048,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B] int64 (-1: a constrained row allowing nothing) and, with want_logprobs,
    their raw log-probabilities [B] float32; the semantics are the module docstring's.

    logits [B, V] float32 (row stride free; never modified); bitmask [B, W] int32 or None (no
    row constrained); constrained [B] bool or None (with a bitmask: every row); temperature,
    top_p, min_p, uniform [B] float32; top_k [B] int32/int64. `uniform` in [0, 1) is the row's
    random number (drawn by the caller from the request's generator): the result is a function
    of the inputs. Launch settings (powers of 2): chunks per row (a tile is chunks x 32
    tokens), num_candidates (cuts per search pass, >= 2), capacity (CAP: the buffer of the
    tokens above the cut), num_warps.
    """
    batch, vocab = check_args(
        logits, bitmask, constrained, temperature, top_k, top_p, min_p, uniform
    )
    check(HAS_TRITON, "masked_sample: Triton is not installed (use masked_sample_reference)")
    # NOTE: a NaN logit (a broken model row) is forbidden: the kernel's searches assume ordered
    # values, and with NaN it could return an id from an unwritten buffer slot. One extra pass.
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    dev = logits.device
    words_v = -(-vocab // 32)
    if chunks is None:  # 128 x 32 tokens a tile: the fastest on an H100 at V = 152k
        chunks = min(128, next_pow2(words_v))
    for name, value, least in (
        ("chunks", chunks, 1),
        ("num_candidates", num_candidates, 2),
        ("capacity", capacity, 16),
    ):
        ok = value >= least and value == next_pow2(value)
        check(ok, "{} must be a power of 2 >= {}, got {}", name, least, value)
    ids = torch.empty(batch, dtype=torch.int64, device=dev)
    logprobs = torch.empty(batch, dtype=torch.float32, device=dev) if want_logprobs else None
    if batch == 0:
        return ids, logprobs
    chunk_words = -(-words_v // chunks)
    # scratch, one allocation: [B, CAP] logits then [B, CAP] ids (int32 bits)
    scratch = torch.empty((2, batch, capacity), dtype=torch.float32, device=dev)
    mask_arg = bitmask if bitmask is not None else logits  # placeholders: never read
    _masked_sample_kernel[(batch,)](
        logits,
        mask_arg,
        constrained.view(torch.uint8) if constrained is not None else ids,
        temperature,
        top_k,
        top_p,
        min_p,
        uniform,
        scratch[0],
        scratch[1].view(torch.int32),
        ids,
        logprobs if logprobs is not None else scratch,
        vocab,
        bitmask.shape[1] if bitmask is not None else 0,
        chunk_words,
        logits.stride(0),
        mask_arg.stride(0),
        HAS_MASK=bitmask is not None,
        HAS_CONSTRAINED=constrained is not None,
        WANT_LOGPROBS=want_logprobs,
        CHUNKS=chunks,
        CHUNK_WORDS=next_pow2(chunk_words),
        NUM_CAND=num_candidates,
        CAP=capacity,
        MAX_PASSES=48,
        num_warps=num_warps if num_warps is not None else min(max(chunks // 8, 1), 16),
    )
    return ids, logprobs
