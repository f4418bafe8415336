"""The torch twin of the masked_sample kernel (kernels/masked_sample.py, whose docstring gives
the semantics): the same token ids, by top-k and sorting, summing in vocabulary order.

It is the sampler's path wherever the kernel does not run: on CPUs, and on CUDA with the fused
kernel turned off (EngineConfig.disable_fused_sampling).
"""

from __future__ import annotations

import torch

from weft.grammars.bitmask import allowed_tokens, count_allowed
from weft.kernels.masked_sample import LOG2E, check_args
from weft.runtime.sampling_params import GREEDY_TEMPERATURE


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
    """The torch twin of `masked_sample`: the same arguments and results.

    NOTE: syncs with the device (it picks the sampled rows and the filters in use).
    """
    _, vocab = check_args(logits, bitmask, constrained, temperature, top_k, top_p, min_p, uniform)
    ids = _greedy_allowed(logits, bitmask, constrained, temperature, top_k)
    if ids is not None:
        if not want_logprobs:
            return ids, None
        return ids, torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0]
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
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
        mass = _kept_mass(
            _rows(lm, rows),
            n_allowed[rows],
            row_max[rows],
            temperature[rows],
            top_k[rows],
            top_p[rows],
            min_p[rows],
        )
        sampled = _draw(mass, uniform[rows])
        sampled = torch.where(sampled >= 0, sampled, ids[rows])  # no kept mass: greedy
        ids = ids.index_copy(0, rows, sampled)
    ids = ids.masked_fill(n_allowed == 0, -1)
    if not want_logprobs:
        return ids, None
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids.clamp_min(0)[:, None])[:, 0]
    return ids, picked.masked_fill(ids < 0, float("nan"))


def _greedy_allowed(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    constrained: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
) -> torch.Tensor | None:
    """The tokens at once where every row is greedy and its largest logit is allowed (None: the
    full path decides). That token is then the answer: the first of the largest allowed.

    NOTE: one pass over the logits instead of five (the NaN scrub, the bitmask expanded to
    [B, V], the masked copy, argmax, the popcount): ~1-2 ms a step of a CPU's decode at 152k
    tokens. A NaN anywhere in a row is its argmax, so a non-NaN maximum means a clean row."""
    if not bool(((temperature < GREEDY_TEMPERATURE) | (top_k == 1)).all()):
        return None
    top, ids = max_and_argmax(logits)
    ok = top > float("-inf")  # (False for NaN too)
    if bitmask is not None:
        word = ids // 32
        inside = word < bitmask.shape[1]  # tokens past the bitmask's words are never allowed
        bits = bitmask.gather(1, word.clamp_max(bitmask.shape[1] - 1)[:, None])[:, 0]
        allowed = inside & (((bits >> (ids % 32).int()) & 1) == 1)
        ok &= allowed if constrained is None else allowed | ~constrained
    return ids if bool(ok.all()) else None


ARGMAX_BLOCK = 128


def max_and_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the largest value [B], the first index holding it [B]) of each row of x [B, V]: what
    argmax answers (a NaN counts as the largest), and its value.

    NOTE: by blocks of ARGMAX_BLOCK: the blocks' maxima (amax), the first block holding the
    row's, argmax within it. On a CPU, amax vectorizes and argmax does not: ~0.04 ms instead of
    ~0.3 ms for one row of a 152k vocabulary (one core).
    """
    rows, vocab = x.shape
    if vocab % ARGMAX_BLOCK or not x.is_contiguous():
        ids = x.argmax(-1)
        return x.gather(1, ids[:, None])[:, 0], ids
    blocks = x.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    maxima = blocks.amax(-1)  # [B, blocks]: NaN where a block holds one
    block = maxima.argmax(-1)  # the first block holding the row's maximum (or first NaN)
    every = torch.arange(rows, device=x.device)
    within = blocks[every, block].argmax(-1)
    return maxima[every, block], block * ARGMAX_BLOCK + within


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] (rows: sorted, distinct), without the copy when rows are all of them.

    NOTE: not index_select: on CPUs it copies a [64, 152k] float tensor ~20x slower.
    """
    return t if rows.numel() == t.shape[0] else t[rows]


def _kept_mass(
    lm: torch.Tensor,  # [R, V] logits, -inf outside the allowed set
    n_allowed: torch.Tensor,
    row_max: torch.Tensor,  # [R] finite
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """e [R, V] of the kept tokens (top-k, top-p, min-p), 0 elsewhere: the draw's weights."""
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
    return e.masked_fill_((lm < theta[:, None]) | (e < min_p[:, None]), 0.0)


def _draw(mass: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row [R], the first token whose running mass exceeds uniform * K (-1: no mass)."""
    vocab = mass.shape[1]
    running = mass.cumsum(-1)  # NOTE: sequential on CPUs: non-decreasing
    target = uniform * running[:, -1]
    # the first running sum > target; where it rises, the token has mass
    first = torch.searchsorted(running, target[:, None], right=True)[:, 0]
    odd = first >= vocab  # rounding (uniform close to 1): no crossing
    odd |= mass.gather(1, first.clamp_max(vocab - 1)[:, None])[:, 0] == 0  # a GPU scan's order
    if bool(odd.any()):
        sel = odd.nonzero()[:, 0]
        pos = torch.arange(vocab, device=mass.device)
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
