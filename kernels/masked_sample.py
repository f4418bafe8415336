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

from weft.grammars.bitmask import allowed_tokens, count_allowed
from weft.kernels._checks import INDEX_DTYPES, check, check_shape, check_tensor, next_pow2

HAS_TRITON = importlib.util.find_spec("triton") is not None

LOG2E = 1.4426950408889634
GREEDY_TEMPERATURE = 1e-5  # a row with temperature below this is greedy

if HAS_TRITON:  # NOTE: the torch twin (the CPU path) must import where Triton is not installed
    import triton
    import triton.language as tl

    # NOTE: a @triton.jit function reads only constexpr globals
    _LOG2E = tl.constexpr(LOG2E)
    _GREEDY_TEMPERATURE = tl.constexpr(GREEDY_TEMPERATURE)
    _NO_KEY = tl.constexpr(1 << 40)  # beyond every key, for min/max over "none"

    @triton.jit
    def _key(x):
        """float32 -> int64 key with the floats' order (magnitude bits, signed; -0.0 -> 0)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, -(b & 0x7FFFFFFF)).to(tl.int64)

    @triton.jit
    def _unkey(k):
        """The float32 of a key (inverse of `_key`), for keys of non-NaN floats."""
        k32 = k.to(tl.int32)
        mag = tl.abs(k32)
        return tl.where(k32 < 0, mag - 2147483647 - 1, mag).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_words(
        l_row, m_row, word, lane, word_ok, vocab, num_words, is_constrained, HAS_MASK: tl.constexpr
    ):
        """Tokens 32 * word + lane (word [.., R, 1] where word_ok, lane [.., 1, 32]): ids,
        logits (-inf outside the vocabulary), allowed. Unconstrained rows read no word."""
        tok = word * 32 + lane
        in_vocab = (tok < vocab) & word_ok
        logit = tl.load(l_row + tok, mask=in_vocab, other=float("-inf"))
        if HAS_MASK:
            # NOTE: tl.where, not `&`: under the interpreter, `&` of a vector and a scalar bool
            # is no longer a bool mask (here and below)
            read = tl.where(is_constrained, word_ok & (word < num_words), False)
            bits = tl.load(m_row + word, mask=read, other=0)
            bits = tl.where(is_constrained, bits, -1)  # -1: all 32 bits set
            allowed = in_vocab & (((bits >> lane) & 1) != 0)
        else:
            allowed = in_vocab
        return tok, logit, allowed

    @triton.jit
    def _kept_mass(lm, row_max, scale, theta, min_p):
        """e of the tokens at or above theta and min_p, 0 elsewhere (lm: -inf outside A)."""
        e = tl.exp2((lm - row_max) * scale)
        return tl.where((lm >= theta) & (e >= min_p), e, 0.0)

    @triton.jit
    def _search(
        l_row,
        m_row,
        vocab,
        chunk_words,
        num_words,
        is_constrained,
        row_max,
        scale,
        top_k,
        need_k,
        top_p,
        need_p,
        n_allowed,
        chunk_allowed,  # [CHUNKS] allowed tokens per chunk
        HAS_MASK: tl.constexpr,
        CHUNKS: tl.constexpr,
        NUM_CAND: tl.constexpr,
        CAP: tl.constexpr,
        MAX_PASSES: tl.constexpr,
    ):
        """Narrow (lo, hi] around theta: G(lo) holds, G(hi) fails (keys). Returns lo, hi, the
        allowed counts above them (n_lo, n_hi; per chunk: chunk_lo, chunk_hi), the mass above
        hi (m_hi) and Z (-1 when no pass ran: then A itself has <= CAP tokens). Stops once
        the tokens above lo or those in (lo, hi] fit in CAP, or hi == lo + 1 (theta = hi)."""
        chunk = tl.arange(0, CHUNKS)
        lane3 = tl.arange(0, 32)[None, None, :]
        slot = tl.arange(0, NUM_CAND)
        words_v = (vocab + 31) // 32
        lo = tl.full([], -0x7F800001, tl.int64)  # below _key(-inf): G holds (count |A| >= k)
        hi = _key(row_max)  # nothing lies above the max: G fails
        n_lo = n_allowed
        n_hi = tl.zeros([], dtype=tl.int32)
        m_hi = tl.zeros([], dtype=tl.float32)
        chunk_lo = chunk_allowed
        chunk_hi = tl.zeros([CHUNKS], dtype=tl.int32)
        z = tl.full([], -1.0, tl.float32)
        passes = 0
        while (n_lo > CAP) & (n_lo - n_hi > CAP) & (hi - lo > 1) & (passes < MAX_PASSES):
            # slot 0 halves (lo, hi) by key: at most ~32 passes whatever the data; the others
            # aim at even shares of the n_lo - n_hi tokens inside, by the counts' logs at lo
            # and hi taken as linear in the logit (a tail); the first pass (no lo yet) tries
            # 1 .. 32 halvings of probability below the max
            v_lo = _unkey(tl.maximum(lo + 1, -0x7F800000))
            if passes == 0:
                below = tl.exp2(slot.to(tl.float32) * (5.0 / (NUM_CAND - 1)))
                cand = _key(row_max - below / scale)
            elif v_lo == float("-inf"):  # G held at no candidate yet: by key alone
                cand = lo + 1 + (hi - lo - 1) * (slot + 1).to(tl.int64) // (NUM_CAND + 1)
            else:
                v_hi = _unkey(hi)
                log_hi = tl.log((n_hi + 1).to(tl.float32))
                share = (slot.to(tl.float32) / NUM_CAND) * (n_lo - n_hi).to(tl.float32)
                frac = (tl.log(n_hi.to(tl.float32) + 1 + share) - log_hi) / (
                    tl.log(n_lo.to(tl.float32)) - log_hi
                )
                cand = _key(v_hi + (v_lo - v_hi) * frac)
            if passes > 0:
                cand = tl.where(slot == 0, lo + (hi - lo) // 2, cand)
            cand = tl.minimum(tl.maximum(cand, lo + 1), hi - 1)
            c_val = _unkey(cand)

            # NOTE: tiles are loaded as [1, CHUNKS, 32] and compared with [NUM_CAND, 1, 1]: one
            # 3-D layout, no layout conversion (through shared memory) per tile
            cuts = c_val[:, None, None]
            count = tl.zeros([NUM_CAND, CHUNKS, 32], dtype=tl.int32)  # per lane: no shuffles
            mass = tl.zeros([NUM_CAND, CHUNKS, 32], dtype=tl.float32)
            z_acc = tl.zeros([1, CHUNKS, 32], dtype=tl.float32)
            for i in range(0, chunk_words):
                word = (chunk * chunk_words + i)[None, :, None]
                _, logit, allowed = _load_words(
                    l_row,
                    m_row,
                    word,
                    lane3,
                    word < words_v,
                    vocab,
                    num_words,
                    is_constrained,
                    HAS_MASK,
                )
                lm = tl.where(allowed, logit, float("-inf"))
                e = tl.exp2((lm - row_max) * scale)
                z_acc += e
                above = lm > cuts  # [NUM_CAND, CHUNKS, 32]
                count += above.to(tl.int32)
                mass += tl.where(above, e, 0.0)
            z = tl.sum(z_acc)
            count = tl.sum(count, 2)  # [NUM_CAND, CHUNKS]
            mass = tl.sum(mass, 2)
            total_count = tl.sum(count, 1)
            total_mass = tl.sum(mass, 1)
            g_k = tl.where(need_k, total_count >= top_k, False)
            g = g_k | tl.where(need_p, total_mass >= top_p * z, False)
            # the largest candidate where G holds becomes lo, the smallest where it fails hi
            best = tl.max(tl.where(g, cand, -_NO_KEY))
            pick = tl.min(tl.where(g & (cand == best), slot, NUM_CAND))
            better = best > lo
            n_lo = tl.where(better, tl.sum(tl.where(slot == pick, total_count, 0)), n_lo)
            chunk_pick = tl.sum(tl.where((slot == pick)[:, None], count, 0), 0)
            chunk_lo = tl.where(better, chunk_pick, chunk_lo)
            lo = tl.maximum(lo, best)
            worst = tl.min(tl.where(g, _NO_KEY, cand))
            pick = tl.min(tl.where(~g & (cand == worst), slot, NUM_CAND))
            lower = worst < hi
            n_hi = tl.where(lower, tl.sum(tl.where(slot == pick, total_count, 0)), n_hi)
            m_hi = tl.where(lower, tl.sum(tl.where(slot == pick, total_mass, 0.0)), m_hi)
            chunk_pick = tl.sum(tl.where((slot == pick)[:, None], count, 0), 0)
            chunk_hi = tl.where(lower, chunk_pick, chunk_hi)
            hi = tl.minimum(hi, worst)
            passes += 1
        return lo, hi, n_lo, n_hi, m_hi, chunk_lo, chunk_hi, z

    @triton.jit
    def _compact(
        l_row,
        m_row,
        buf_v,
        buf_i,
        vocab,
        chunk_words,
        num_words,
        is_constrained,
        lower,
        upper,
        chunk_count,  # [CHUNKS] allowed tokens in [lower, upper] per chunk
        HAS_MASK: tl.constexpr,
        CHUNKS: tl.constexpr,
        CAP: tl.constexpr,
    ):
        """The allowed tokens with lower <= logit <= upper, in id order, to buf_v / buf_i."""
        chunk = tl.arange(0, CHUNKS)
        lane = tl.arange(0, 32)[None, :]
        words_v = (vocab + 31) // 32
        at = tl.cumsum(chunk_count, 0) - chunk_count  # [CHUNKS] where each chunk starts
        for i in range(0, chunk_words):
            word = (chunk * chunk_words + i)[:, None]
            tok, logit, allowed = _load_words(
                l_row, m_row, word, lane, word < words_v, vocab, num_words, is_constrained, HAS_MASK
            )
            keep = (allowed & (logit >= lower) & (logit <= upper)).to(tl.int32)
            pos = at[:, None] + tl.cumsum(keep, 1) - keep
            ok = (keep != 0) & (pos < CAP)  # NOTE: pos < CAP always (the counts); never overrun
            tl.store(buf_v + pos, logit, mask=ok)
            tl.store(buf_i + pos, tok, mask=ok)
            at += tl.sum(keep, 1)

    @triton.jit
    def _buffer_theta(
        buf_v,
        n,
        row_max,
        scale,
        z,
        n_above,
        m_above,
        top_k,
        need_k,
        top_p,
        need_p,
        CAP: tl.constexpr,
    ):
        """theta from the n buffered tokens, the top of (lo, hi]; n_above tokens of mass
        m_above lie above them (0, 0 when the buffer holds all tokens above lo)."""
        r = tl.arange(0, CAP)
        desc = tl.sort(tl.load(buf_v + r, mask=r < n, other=float("-inf")), descending=True)
        # top-k: the k-th largest overall; past the buffer it is below lo, so irrelevant
        theta_k = tl.max(tl.where(r == top_k - n_above - 1, desc, float("-inf")))
        theta_k = tl.where(need_k, theta_k, float("-inf"))
        # top-p: the last position with less mass before it than top_p * Z holds theta_p (ties
        # with it come later, and are kept by value); G fails at hi: position 0 qualifies
        desc_e = tl.exp2((desc - row_max) * scale)
        before = m_above + (tl.cumsum(desc_e, 0) - desc_e)
        last_p = tl.sum(((before < top_p * z) & (r < n)).to(tl.int32)) - 1
        last_p = tl.maximum(last_p, 0)  # top_p <= 0 (invalid): the top value, as the twin
        theta_p = tl.max(tl.where(r == last_p, desc, float("-inf")))
        theta_p = tl.where(need_p, theta_p, float("-inf"))
        return tl.maximum(theta_k, theta_p)

    @triton.jit
    def _buffer_mass(buf_v, n, row_max, scale, CAP: tl.constexpr):
        r = tl.arange(0, CAP)
        v = tl.load(buf_v + r, mask=r < n, other=float("-inf"))
        return tl.sum(tl.exp2((v - row_max) * scale))

    @triton.jit
    def _draw_buffer(buf_v, buf_i, n, row_max, scale, theta, min_p, u, CAP: tl.constexpr):
        """The draw over the n buffered tokens (in id order; every kept token is there)."""
        r = tl.arange(0, CAP)
        valid = r < n
        v = tl.load(buf_v + r, mask=valid, other=float("-inf"))
        w = tl.where(valid, _kept_mass(v, row_max, scale, theta, min_p), 0.0)
        running = tl.cumsum(w, 0)
        target = u * tl.sum(w)
        hit = tl.min(tl.where((running > target) & (w > 0), r, CAP))
        # rounding (uniform close to 1) may leave no crossing: the last kept token with mass
        hit = tl.where(hit < CAP, hit, tl.max(tl.where(w > 0, r, -1)))
        return tl.where(hit >= 0, tl.load(buf_i + tl.maximum(hit, 0)), -1)  # -1: no mass

    @triton.jit
    def _draw_chunks(
        l_row,
        m_row,
        vocab,
        chunk_words,
        num_words,
        is_constrained,
        row_max,
        scale,
        theta,
        min_p,
        u,
        HAS_MASK: tl.constexpr,
        CHUNKS: tl.constexpr,
        CHUNK_WORDS: tl.constexpr,
    ):
        """The draw over the whole row: kept mass per chunk, then one chunk scanned."""
        chunk = tl.arange(0, CHUNKS)
        lane = tl.arange(0, 32)[None, :]
        words_v = (vocab + 31) // 32
        acc = tl.zeros([CHUNKS, 32], dtype=tl.float32)
        for i in range(0, chunk_words):
            word = (chunk * chunk_words + i)[:, None]
            _, logit, allowed = _load_words(
                l_row, m_row, word, lane, word < words_v, vocab, num_words, is_constrained, HAS_MASK
            )
            acc += _kept_mass(tl.where(allowed, logit, float("-inf")), row_max, scale, theta, min_p)
        chunk_mass = tl.sum(acc, 1)
        target = u * tl.sum(chunk_mass)
        crossed = (tl.cumsum(chunk_mass, 0) > target) & (chunk_mass > 0)
        first = tl.min(tl.where(crossed, chunk, CHUNKS))
        # K >= 1 (the argmax is kept with e = 1) unless min_p > 1 (then -1, below)
        c = tl.where(first < CHUNKS, first, tl.max(tl.where(chunk_mass > 0, chunk, 0)))
        base = tl.sum(tl.where(chunk < c, chunk_mass, 0.0))

        wi = tl.arange(0, CHUNK_WORDS)[:, None]
        word = c * chunk_words + wi
        tok, logit, allowed = _load_words(
            l_row,
            m_row,
            word,
            lane,
            (wi < chunk_words) & (word < words_v),
            vocab,
            num_words,
            is_constrained,
            HAS_MASK,
        )
        w = _kept_mass(tl.where(allowed, logit, float("-inf")), row_max, scale, theta, min_p)
        word_mass = tl.sum(w, 1)
        running = base + (tl.cumsum(word_mass, 0) - word_mass)[:, None] + tl.cumsum(w, 1)
        hit = tl.min(tl.where((running > target) & (w > 0), tok, vocab))
        # rounding (uniform close to 1) may leave no crossing: the last kept token with mass
        return tl.where(hit < vocab, hit, tl.max(tl.where(w > 0, tok, -1)))  # -1: no mass

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
                        buf_v + row * CAP,
                        buf_i + row * CAP,
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
                        z = _buffer_mass(buf_v + row * CAP, n_buf, row_max, scale, CAP)
                    theta_buf = _buffer_theta(
                        buf_v + row * CAP,
                        n_buf,
                        row_max,
                        scale,
                        z,
                        tl.where(in_buffer, 0, n_hi),
                        tl.where(in_buffer, 0.0, m_hi),
                        k,
                        need_k,
                        p,
                        need_p,
                        CAP,
                    )
                    # no token in (lo, hi]: any value there keeps the same set
                    theta = tl.where(n_buf > 0, theta_buf, theta)
            if in_buffer:
                chosen = _draw_buffer(
                    buf_v + row * CAP, buf_i + row * CAP, n_lo, row_max, scale, theta, mp, u, CAP
                )
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


def _check_args(
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
        check(
            bitmask.shape[0] == batch,
            "bitmask: {} rows for {} logits rows",
            bitmask.shape[0],
            batch,
        )
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
    batch, vocab = _check_args(
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
        check(
            value >= least and value == next_pow2(value),
            "{} must be a power of 2 >= {}, got {}",
            name,
            least,
            value,
        )
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


def masked_sample_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    constrained: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    want_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch twin of `masked_sample` (the CPU path): the same results, by top-k / sorting.

    NOTE: syncs with the device (it picks the sampled rows and the filters in use).
    """
    _, vocab = _check_args(logits, bitmask, constrained, temperature, top_k, top_p, min_p, uniform)
    allowed = allowed_tokens(bitmask, constrained, vocab)
    lm = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    ids = lm.argmax(-1)  # the first of the largest
    row_max = lm.gather(1, ids[:, None])[:, 0]
    no_mass = row_max == float("-inf")
    if allowed is not None and bool(no_mass.any()):
        # all allowed logits -inf: the smallest allowed id (argmax may have found a masked one)
        ids = torch.where(no_mass, allowed.int().argmax(-1), ids)
    if bitmask is None:
        n_allowed = torch.full_like(ids, vocab)
    else:
        n_allowed = count_allowed(bitmask, constrained, vocab)
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1) | no_mass
    rows = (~greedy & (n_allowed > 0)).nonzero()[:, 0]
    if rows.numel() > 0:
        sampled = _sample_rows(
            _rows(lm, rows),
            n_allowed[rows],
            row_max[rows],
            temperature[rows],
            top_k[rows],
            top_p[rows],
            min_p[rows],
            uniform[rows],
        )
        sampled = torch.where(sampled >= 0, sampled, ids[rows])  # no kept mass: greedy
        ids = ids.index_copy(0, rows, sampled)
    ids = ids.masked_fill(n_allowed == 0, -1)
    if not want_logprobs:
        return ids, None
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids.clamp_min(0)[:, None])[:, 0]
    return ids, picked.masked_fill(ids < 0, float("nan"))


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] (rows: sorted, distinct), without the copy when rows are all of them.

    NOTE: not index_select: on CPUs it copies a [64, 152k] float tensor ~20x slower.
    """
    return t if rows.numel() == t.shape[0] else t[rows]


def _sample_rows(
    lm: torch.Tensor,  # [R, V] logits, -inf outside the allowed set
    n_allowed: torch.Tensor,
    row_max: torch.Tensor,  # [R] finite
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    vocab = lm.shape[1]
    scale = (1.0 / temperature) * LOG2E  # the kernel's exp2 form
    e = torch.exp2((lm - row_max[:, None]) * scale[:, None])  # [R, V], 0 outside A
    theta = torch.full_like(row_max, float("-inf"))

    need_k = (top_k > 0) & (top_k < n_allowed)
    if bool(need_k.any()):  # the k-th largest allowed logit
        sel = need_k.nonzero()[:, 0]
        k = top_k[sel].long()
        largest = _rows(lm, sel).topk(int(k.max()), dim=-1).values
        theta[sel] = largest.gather(1, (k - 1)[:, None])[:, 0]

    need_p = top_p < 1.0
    if bool(need_p.any()):
        sel = need_p.nonzero()[:, 0]
        bound = top_p[sel] * _rows(e, sel).sum(-1)
        theta_p = _top_p_threshold(_rows(lm, sel), row_max[sel], scale[sel], bound)
        theta[sel] = torch.maximum(theta[sel], theta_p)

    # outside A: lm = -inf and e = 0, never drawn whatever the filters
    mass = e.masked_fill_((lm < theta[:, None]) | (e < min_p[:, None]), 0.0)
    running = mass.cumsum(-1)  # NOTE: sequential on CPUs: non-decreasing
    target = uniform * running[:, -1]
    # the first running sum > target; where it rises, the token has mass
    first = torch.searchsorted(running, target[:, None], right=True)[:, 0]
    odd = first >= vocab  # rounding (uniform close to 1): no crossing
    odd |= mass.gather(1, first.clamp_max(vocab - 1)[:, None])[:, 0] == 0  # a GPU scan's order
    if bool(odd.any()):
        sel = odd.nonzero()[:, 0]
        pos = torch.arange(vocab, device=lm.device)
        m, r = mass[sel], running[sel]
        crossed = (r > target[sel, None]) & (m > 0)
        hit = torch.where(crossed, pos, vocab).amin(-1)
        last = torch.where(m > 0, pos, -1).amax(-1)  # no crossing: the last kept token with mass
        # (-1: no kept mass)
        first = first.index_copy(0, sel, torch.where(hit < vocab, hit, last))
    return first


def _top_p_threshold(
    lm: torch.Tensor, row_max: torch.Tensor, scale: torch.Tensor, bound: torch.Tensor
) -> torch.Tensor:
    """theta_p [R]: the smallest logit l_i with (mass of logits > l_i) < bound.

    The tokens in descending order with their exclusive running mass: the last position whose
    mass before it is < bound holds theta_p (ties with it come later and are kept by value).
    NOTE: a full sort of 64 x 152k logits costs ~0.35 s on two CPU cores; the prefix rarely
    needs more than the top 1024, so we sort the top `width` and widen only rows not resolved.
    """
    vocab = lm.shape[1]
    theta = torch.empty_like(row_max)
    todo = torch.arange(lm.shape[0], device=lm.device)
    width = min(vocab, 1024)
    while todo.numel() > 0:
        top = _rows(lm, todo).topk(width, dim=-1).values  # sorted, descending
        e = torch.exp2((top - row_max[todo, None]) * scale[todo, None])
        before = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1].cumsum(-1)], dim=-1)
        # >= 1 (nothing comes before the first) for top_p > 0; top_p <= 0 keeps the top
        count = (before < bound[todo, None]).sum(-1).clamp_min(1)
        done = (count < width) | (width == vocab)
        theta[todo[done]] = top[done].gather(1, (count[done] - 1)[:, None])[:, 0]
        todo = todo[~done]
        width = min(vocab, width * 16)
    return theta


def masked_sample_auto(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    constrained: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    want_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton kernel for CUDA tensors (where Triton is installed), the torch twin otherwise."""
    fn = masked_sample if logits.is_cuda and HAS_TRITON else masked_sample_reference
    return fn(
        logits, bitmask, constrained, temperature, top_k, top_p, min_p, uniform, want_logprobs
    )
