"""The device functions of the masked_sample kernel (kernels/masked_sample.py, whose docstring
describes the passes): the tile loads, the search for theta, the compaction into the candidate
buffer, and the draw over the buffer or over the row's chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl

# NOTE: a @triton.jit function reads only constexpr globals
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
            word_ok = word < words_v
            _, logit, allowed = _load_words(
                l_row, m_row, word, lane3, word_ok, vocab, num_words, is_constrained, HAS_MASK
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
    buf_v, n, row_max, scale, z, n_above, m_above, top_k, need_k, top_p, need_p, CAP: tl.constexpr
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
    word_ok = (wi < chunk_words) & (word < words_v)
    tok, logit, allowed = _load_words(
        l_row, m_row, word, lane, word_ok, vocab, num_words, is_constrained, HAS_MASK
    )
    w = _kept_mass(tl.where(allowed, logit, float("-inf")), row_max, scale, theta, min_p)
    word_mass = tl.sum(w, 1)
    running = base + (tl.cumsum(word_mass, 0) - word_mass)[:, None] + tl.cumsum(w, 1)
    hit = tl.min(tl.where((running > target) & (w > 0), tok, vocab))
    # rounding (uniform close to 1) may leave no crossing: the last kept token with mass
    return tl.where(hit < vocab, hit, tl.max(tl.where(w > 0, tok, -1)))  # -1: no mass
