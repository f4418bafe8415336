"""Turning logits into tokens: penalties, min_new_tokens, temperature, top-k/top-p/min-p, seeds.

Logprobs are reported from the model's raw distribution (log_softmax of the logits, before
penalties and temperature), as vLLM and SGLang do by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.grammars.bitmask import allowed_tokens
from weft.kernels.masked_sample import HAS_TRITON, masked_sample
from weft.runtime.core import Req

# The fused Triton mask + sample kernel on CUDA (the torch path below otherwise, and on CPUs).
USE_FUSED_KERNEL = True


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top: list[list[tuple[float, int]]] | None  # per row, the top alternatives asked for


def sample(
    logits: torch.Tensor,
    reqs: list[Req],
    end_ids: frozenset[int],
    bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> Sampled:
    """logits: [B, V] float32, one row per request in `reqs` (rows may be modified).
    bitmask: (int32 [B, ceil(V/32)], the rows it constrains) for grammar-constrained requests."""
    return read_back(*sample_on_device(logits, reqs, end_ids, bitmask), reqs)


def sample_on_device(
    logits: torch.Tensor,
    reqs: list[Req],
    end_ids: frozenset[int],
    bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample` without reading the result back: (token ids [B], raw logprobs [B, V] or None),
    launched on the logits' device (no host sync on the fused CUDA path)."""
    want_logprobs = any(r.logprob is not None for r in reqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    _apply_penalties(logits, reqs)
    _block_early_stop(logits, reqs, end_ids)
    if uses_fused_kernel(logits.device):
        return _sample_fused(logits, reqs, bitmask), raw_logprobs
    if bitmask is not None:
        apply_bitmask(logits, *bitmask)

    chosen = torch.argmax(logits, dim=-1)  # greedy rows are done here
    sampled_rows = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [reqs[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            chosen[i] = torch.multinomial(probs[j], 1, generator=reqs[i].generator)[0]
    return chosen, raw_logprobs


def uses_fused_kernel(device: torch.device) -> bool:
    """Whether logits on `device` are sampled by the fused Triton kernel (`_sample_fused`): on
    CUDA where Triton is installed, unless USE_FUSED_KERNEL is off."""
    return device.type == "cuda" and USE_FUSED_KERNEL and HAS_TRITON


def read_back(chosen: torch.Tensor, raw_logprobs: torch.Tensor | None, reqs: list[Req]) -> Sampled:
    """The host lists of a `sample_on_device` result (waits for the device)."""
    ids = chosen.tolist()
    if raw_logprobs is None:
        return Sampled(ids, None, None)
    picked = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    top = [
        top_logprobs(raw_logprobs[i], r.logprob.top_k) if r.logprob else []
        for i, r in enumerate(reqs)
    ]
    return Sampled(ids, picked, top)


def _sample_fused(
    logits: torch.Tensor, reqs: list[Req], bitmask: tuple[torch.Tensor, list[int]] | None
) -> torch.Tensor:
    """One Triton kernel: the grammar mask, temperature, top-k/top-p/min-p and the draw.

    NOTE: each sampled row draws its uniform from the request's own generator, so seeded
    requests repeat; the kernel draws by inverse CDF in vocabulary order, not with
    torch.multinomial, so a seed gives other samples here than on the CPU.
    """
    device = logits.device
    params = [r.params for r in reqs]
    zero = torch.zeros((), device=device)
    uniform = torch.stack(
        [
            zero if p.is_greedy else torch.rand((), generator=r.generator, device=device)
            for p, r in zip(params, reqs, strict=True)
        ]
    )
    # NOTE: pinned: a copy from pageable memory may wait for the stream (the forward in flight
    # under the overlap schedule)
    # NOTE: one row per parameter, each padded to 16 bytes: Triton specializes the kernel on
    # its pointers' 16-byte alignment, and the columns of a [B, 4] tensor are aligned or not
    # depending on B (one row: views at 4-byte offsets), so a lone row compiled it anew (~7 s)
    width = -(-len(params) // 4) * 4
    table = torch.zeros((4, width), dtype=torch.float32)
    table[:, : len(params)] = torch.tensor(
        [[p.temperature, p.top_p, p.min_p, p.top_k] for p in params], dtype=torch.float32
    ).T
    host = _to_device(table, device)
    words, constrained = None, None
    if bitmask is not None:
        words, rows = bitmask
        flags = torch.zeros(len(reqs), dtype=torch.bool)
        flags[rows] = True
        constrained = _to_device(flags, device)
    ids, _ = masked_sample(
        logits.float().contiguous(),
        words,
        constrained,
        host[0, : len(params)],
        host[3, : len(params)].to(torch.int32),
        host[1, : len(params)],
        host[2, : len(params)],
        uniform,
    )
    return ids


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and copied without a sync on CUDA; on a CPU (the fused
    path under Triton's interpreter, in tests) the tensor itself."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Forbid what the grammar forbids in the constrained rows. A row whose allowed tokens were
    all blocked otherwise (min_new_tokens against a grammar that can only end) keeps the
    grammar's tokens: the grammar wins."""
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask[index], None, logits.shape[-1])
    assert allowed is not None
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    # NOTE: no host sync on `stuck` (a decode step syncs once, when the tokens are read)
    stuck = torch.isneginf(masked).all(dim=-1, keepdim=True)
    grammar_only = torch.zeros_like(masked).masked_fill(~allowed, float("-inf"))
    logits[index] = torch.where(stuck, grammar_only, masked)


def top_logprobs(row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, indices = torch.topk(row, min(k, row.shape[-1]))
    return list(zip(values.tolist(), indices.tolist(), strict=True))


def _apply_penalties(logits: torch.Tensor, reqs: list[Req]) -> None:
    for i, req in enumerate(reqs):
        p = req.params
        if not p.has_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            # HF semantics: over prompt and output tokens, divide positive logits, scale negatives
            seen = torch.tensor(sorted(set(req.fill_ids)), device=row.device, dtype=torch.int64)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if req.output_ids and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            # OpenAI semantics: over output tokens only
            out = torch.tensor(req.output_ids, device=row.device, dtype=torch.int64)
            counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _block_early_stop(logits: torch.Tensor, reqs: list[Req], end_ids: frozenset[int]) -> None:
    for i, req in enumerate(reqs):
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            continue
        blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(end_ids))
        if blocked:
            logits[i, sorted(blocked)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Probabilities [R, V] after temperature, top-k, top-p and min-p."""
    temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=probs.device)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= ks[:, None]
        ps = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= ps[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=probs.device, dtype=probs.dtype)
    if bool((min_p > 0).any()):
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * peak, 0.0)
    # NOTE: extreme penalties can leave a row without finite mass; fall back to its best token
    probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    mass = probs.sum(dim=-1, keepdim=True)
    empty = mass[:, 0] <= 0
    if bool(empty.any()):
        best = torch.nan_to_num(logits[empty], nan=float("-inf")).argmax(dim=-1)
        probs[empty] = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)
        mass = probs.sum(dim=-1, keepdim=True)
    return probs / mass
