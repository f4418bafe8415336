"""Turning the scheduler's work list into a ForwardBatch, plus the plan for reading its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weft.runtime.core import ForwardBatch, Req
from weft.runtime.scheduler.memory import MemoryManager

ALIGN_INT64 = 2  # int64s per 16 bytes


@dataclass
class RowPlan:
    """Which hidden rows of a step belong to one request, and what they are for."""

    req: Req
    num_tokens: int
    sample_row: int | None = None  # row whose logits pick the next token
    prompt_rows: list[int] = field(default_factory=list)  # rows scored for prompt logprobs
    prompt_positions: list[int] = field(default_factory=list)  # the position each row predicts
    # draft tokens fed behind the request's tokens (core.py): the rows after sample_row are
    # its samples after each of them
    draft: list[int] = field(default_factory=list)


def build_batch(
    work: list[tuple[Req, int]],
    memory: MemoryManager,
    device: torch.device,
    *,
    token_rows_apart: bool = False,
) -> tuple[ForwardBatch, list[RowPlan]]:
    """Allocates the step's KV slots and lays the requests' new tokens out contiguously.

    A request's pending token (`Req.pending`, overlap schedule) is fed by
    `ForwardBatch.feed_pending` from the previous step's sampled ids, on the device, not from
    the host: that sampling may be launched after this layout.
    A work item past the end of a request's tokens feeds that many tokens of its draft.

    token_rows_apart: every new token is a request of the batch of its own (its req_to_token
    row, its position + 1 as its length): a decode batch (`ForwardBatch.is_decode`) even where
    drafts are fed, which a CUDA graph of decode steps replays (`verify_rows_apart`). Each
    token's K/V is stored before any row attends, so a draft token sees those before it.
    """
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    token_rows: list[int] = []  # the req_to_token row of each new token
    seq_lens: list[int] = []
    prefix_lens: list[int] = []
    ext_lens: list[int] = []
    output_only: list[bool] = []
    logits_rows: list[int] = []
    plans = []
    future_at: list[int] = []  # positions in ids of pending tokens ...
    future_rows: list[int] = []  # ... and their rows in the previous step's sampled ids
    for req, n in work:
        start = req.kv_len
        draft = req.draft[: max(start + n - req.seq_len, 0)]
        if draft:
            assert req.pending is None, "a draft must follow tokens on the host"
            ids.extend(req.tokens(start, req.seq_len))
            ids.extend(draft)
        elif req.pending is not None and start + n == req.seq_len:
            ids.extend(req.tokens(start, start + n - 1))
            future_at.append(len(ids))
            future_rows.append(req.pending[1])
            ids.append(0)  # its value is copied on the device (ForwardBatch.feed_pending)
        else:
            ids.extend(req.tokens(start, start + n))
        positions.extend(range(start, start + n))
        assert req.req_pool_idx is not None
        token_rows.extend([req.req_pool_idx] * n)
        for lo, size in [(start + j, 1) for j in range(n)] if token_rows_apart else [(start, n)]:
            rows.append(req.req_pool_idx)
            seq_lens.append(lo + size)
            prefix_lens.append(lo)
            ext_lens.append(size)
            output_only.append(lo >= len(req.input_ids))
        plan = RowPlan(req, n, draft=list(draft))
        base = len(ids) - n
        for q in _scored_positions(req, start, n):
            plan.prompt_rows.append(len(logits_rows))
            plan.prompt_positions.append(q + 1)
            logits_rows.append(base + q - start)
        if start + n == req.seq_len + len(draft) and not _scoring_only(req):
            plan.sample_row = len(logits_rows)
            logits_rows.extend(range(base + n - 1 - len(draft), base + n))
        plans.append(plan)

    # NOTE: one host buffer, one copy to the device (per-field copies each cost a host sync).
    # Every field starts 16-byte aligned in it (padded to an even count of int64s): Triton
    # specializes a kernel on its pointers' 16-byte alignment, so fields at shifting offsets
    # compiled kernels anew (seconds each) in the middle of a busy server's steps.
    fields = {
        "ids": ids,
        "positions": positions,
        "rows": rows,
        "seq_lens": seq_lens,
        "prefix_lens": prefix_lens,
        "ext_lens": ext_lens,
        "logits_rows": logits_rows,
        "token_rows": token_rows,
        "future_at": future_at,
        "future_rows": future_rows,
    }
    cache_loc = memory.allocate(token_rows, positions)
    flat: list[int] = []
    sizes = []
    for values in fields.values():
        pad = -len(values) % ALIGN_INT64
        flat += values + [0] * pad
        sizes.append(len(values) + pad)
    host = torch.cat([torch.tensor(flat, dtype=torch.int64), cache_loc])
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    *columns, loc = host.split([*sizes, len(cache_loc)])
    dev = {
        name: column[: len(values)]
        for (name, values), column in zip(fields.items(), columns, strict=True)
    }
    batch = ForwardBatch(
        input_ids=dev["ids"],
        positions=dev["positions"],
        out_cache_loc=loc,
        req_pool_indices=dev["rows"],
        seq_lens=dev["seq_lens"],
        prefix_lens=dev["prefix_lens"],
        extend_lens=dev["ext_lens"],
        logits_indices=dev["logits_rows"],
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=ext_lens,
        output_only_cpu=output_only,
    )
    memory.req_to_token.scatter(dev["token_rows"], batch.positions, loc)
    if future_at:
        batch.pending_at, batch.pending_rows = dev["future_at"], dev["future_rows"]
    return batch, plans


def verify_rows_apart(work: list[tuple[Req, int]], max_rows: int | None) -> bool:
    """Whether a step's tokens go as requests of one token each (`build_batch`'s
    token_rows_apart): where it feeds drafts behind decode tokens only, and a CUDA graph of
    `max_rows` rows or more can replay it (None: no graphs). Its verify rows then cost what a
    decode batch of as many rows costs, without the whole step running eagerly. (Each row reads
    its request's KV in full: for long contexts at small batches, more than an extend step.)"""
    if max_rows is None:
        return False
    rows = sum(n for _, n in work)
    drafts = rows > len(work)
    return drafts and rows <= max_rows and all(req.seq_len - req.kv_len == 1 for req, _ in work)


def _scoring_only(req: Req) -> bool:
    return req.params.max_new_tokens == 0


def _scored_positions(req: Req, start: int, n: int) -> range:
    """Positions q in this step whose logits score prompt token q + 1 (not yet recorded)."""
    if req.logprob is None or req.logprob.start_len < 0:
        return range(0)
    prompt_len = len(req.input_ids)
    first_target = max(req.logprob.start_len, 1)
    # NOTE: after a retraction the prompt is recomputed; positions already scored are skipped.
    recorded = len(req.input_logprobs) - (1 if req.logprob.start_len == 0 else 0)
    lo = max(start, first_target - 1 + max(recorded, 0))
    hi = min(start + n, prompt_len - 1)
    return range(lo, max(lo, hi))
