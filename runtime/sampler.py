"""Turning logits into tokens: penalties and min_new_tokens here, then one draw (the grammar mask,
temperature, top-k/top-p/min-p, the request's seeded generator) by the masked_sample kernel on
CUDA or by its torch twin elsewhere: one semantics (kernels/masked_sample.py's docstring).

Logprobs are reported from the model's raw distribution (log_softmax of the logits, before
penalties and temperature), as vLLM and SGLang do by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from weft.kernels.masked_sample import HAS_TRITON, masked_sample
from weft.kernels.masked_sample_ref import masked_sample_reference
from weft.runtime.core import Req


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top: list[list[tuple[float, int]]] | None  # per row, the top alternatives asked for


def sample_on_device(
    logits: torch.Tensor,
    reqs: list[Req],
    end_ids: frozenset[int],
    bitmask: tuple[torch.Tensor, list[int]] | None = None,
    *,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token ids [B], -1 for a constrained row that allows nothing; raw logprobs [B, V] or None),
    launched on the logits' device (no host sync on the fused CUDA path; `read_back` waits).

    logits: [B, V] float32, one row per request in `reqs` (rows may be modified).
    bitmask: (int32 [B, ceil(V/32)], the rows it constrains) for grammar-constrained requests.
    fused: the fused kernel for CUDA logits (EngineConfig.disable_fused_sampling turns it off)."""
    want_logprobs = any(r.logprob is not None for r in reqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    _apply_penalties(logits, reqs)
    _block_early_stop(logits, reqs, end_ids)
    kernel = masked_sample if uses_fused_kernel(logits.device, fused) else masked_sample_reference
    return _draw(kernel, logits, reqs, bitmask), raw_logprobs


def uses_fused_kernel(device: torch.device, fused: bool) -> bool:
    """Whether logits on `device` are drawn by the fused Triton kernel: on CUDA where Triton is
    installed, unless `fused` is off (else by its torch twin)."""
    return device.type == "cuda" and fused and HAS_TRITON


def read_back(chosen: torch.Tensor, raw_logprobs: torch.Tensor | None, reqs: list[Req]) -> Sampled:
    """The host lists of a `sample_on_device` result (waits for the device)."""
    ids = chosen.tolist()
    if raw_logprobs is None:
        return Sampled(ids, None, None)
    # NOTE: clamped: a -1 (nothing allowed) ends its request; its logprob is never reported
    picked = raw_logprobs.gather(1, chosen.clamp_min(0)[:, None])[:, 0].tolist()
    top = [
        top_logprobs(raw_logprobs[i], r.logprob.top_k) if r.logprob else []
        for i, r in enumerate(reqs)
    ]
    return Sampled(ids, picked, top)


def _draw(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    logits: torch.Tensor,
    reqs: list[Req],
    bitmask: tuple[torch.Tensor, list[int]] | None,
) -> torch.Tensor:
    """The token ids [B] by `kernel` (masked_sample or its twin), its arguments built here.

    NOTE: each sampled row draws its uniform from the request's own generator, so seeded
    requests repeat; the draw is by inverse CDF in vocabulary order (not torch.multinomial).
    """
    device = logits.device
    params = [r.params for r in reqs]
    n = len(params)
    if all(p.is_greedy for p in params):
        uniform = torch.zeros(n, device=device)  # (one launch, not a stack of n scalars)
    else:
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
    # (the fifth row: which rows the bitmask constrains, in the same copy)
    table = torch.zeros((5, -(-n // 4) * 4), dtype=torch.float32)
    values = [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params]
    table[:4, :n] = torch.tensor(values, dtype=torch.float32).T
    words, rows = bitmask if bitmask is not None else (None, [])
    table[4, rows] = 1.0
    temperature, top_k, top_p, min_p, flags = _to_device(table, device)[:, :n]
    constrained = flags != 0 if words is not None else None
    logits = logits.float().contiguous()
    top_k = top_k.to(torch.int32)
    return kernel(logits, words, constrained, temperature, top_k, top_p, min_p, uniform)[0]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and copied without a sync on CUDA; on a CPU the tensor
    itself."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
