"""Tensor-parallel steps: the scheduler on rank 0 drives, the other ranks follow.

Rank 0 decides everything (admission, KV slots, req_to_token, the radix cache, grammars,
sampling). Every other rank holds its slice of the model and a KV pool with the same slots, and
runs each `forward` and `logits` call rank 0 runs, with the same inputs and in the same order,
so that the layers' collectives pair up; it discards its logits (rank 0's are whole: the
lm_head all-gathers them).

What rank 0 broadcasts before each call (T tokens, B requests, K hidden rows, J journal ints):

    | call    | over the control group (gloo, host)       | over the model's group (NCCL / gloo)     |
    |---------|-------------------------------------------|------------------------------------------|
    | forward | header; seq_lens, prefix_lens,            | input_ids (pending tokens filled in),    |
    |         | extend_lens [B each]; the req_to_token    | positions, out_cache_loc [T each],       |
    |         | journal [J]                               | req_pool_indices, seq_lens, prefix_lens, |
    |         |                                           | extend_lens [B each], logits_indices [K] |
    | logits  | header                                    | the rows of the last forward's hidden    |
    |         |                                           | states [n] (none: all of them)           |
    | stop    | header                                    | -                                        |

header = [op, T or n, B, K, J, exact_lens]. The host values travel on the control group, so that
on CUDA no rank reads a device tensor back to the host; the device values travel on the model's
group (on CUDA: NCCL, queued on the stream like the forward itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import assert_never

import torch
import torch.distributed as dist

from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import ReqToTokenPool
from weft.runtime.model_runner import ModelRunner
from weft.runtime.parallel import TPGroup

HEADER_LEN = 6


class Op(IntEnum):
    FORWARD = 0
    LOGITS = 1
    STOP = 2


@dataclass(frozen=True)
class TPLink:
    """The channel from rank 0 to the other ranks: the model's group, and a gloo group on the
    host for what the followers must know before they receive the device values."""

    tp: TPGroup
    control: dist.ProcessGroup

    def send(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.int64), src=0, group=self.control)

    def receive(self, n: int) -> list[int]:
        box = torch.empty(n, dtype=torch.int64)
        dist.broadcast(box, src=0, group=self.control)
        return box.tolist()

    def share(self, device_values: torch.Tensor) -> torch.Tensor:
        """Rank 0's int64 device tensor on every rank (the others pass an empty one to fill)."""
        dist.broadcast(device_values, src=0, group=self.tp.group)
        return device_values


class TPDriver:
    """Rank 0's model runner under tensor parallelism: each `forward` and `logits` call tells the
    other ranks to run it too, then runs it here (the same signatures as ModelRunner's)."""

    def __init__(self, runner: ModelRunner, link: TPLink) -> None:
        self.runner = runner
        self.link = link
        self.journal: list[int] = []
        # NOTE: rank 0's MemoryManager writes req_to_token rows (a request's cached prefix,
        # the cache's slots after a prefill chunk) on rank 0 only: the pool keeps a journal of
        # those writes, replayed by the followers before the next forward. The step's own slots
        # (out_cache_loc) they write from the batch, as build_batch does here.
        runner.req_to_token.journal = self.journal

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """As ModelRunner.forward; the batch's pending tokens must be fed already."""
        assert batch.pending_at is None, "feed_pending before the forward: followers never sample"
        b = batch
        header = [Op.FORWARD, b.num_tokens, b.batch_size, int(b.logits_indices.shape[0])]
        header += [len(self.journal), int(b.exact_lens)]
        self.link.send(header)
        self.link.send(b.seq_lens_cpu + b.prefix_lens_cpu + b.extend_lens_cpu + self.journal)
        self.journal.clear()
        per_token = [b.input_ids, b.positions, b.out_cache_loc]
        per_request = [b.req_pool_indices, b.seq_lens, b.prefix_lens, b.extend_lens]
        self.link.share(torch.cat([*per_token, *per_request, b.logits_indices]))
        return self.runner.forward(batch)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.logits."""
        self.link.send([Op.LOGITS, -1 if rows is None else rows.numel(), 0, 0, 0, 0])
        if rows is not None:
            self.link.share(rows.to(torch.int64))
        return self.runner.logits(hidden, rows)

    def stop(self) -> None:
        """Tell the other ranks to exit their loop (`follow` returns)."""
        self.link.send([Op.STOP, 0, 0, 0, 0, 0])


def follow(runner: ModelRunner, link: TPLink) -> None:
    """A rank > 0's life once its model is built: run rank 0's calls until it says stop."""
    hidden: torch.Tensor | None = None
    while True:
        op, n, bs, k, j, exact = link.receive(HEADER_LEN)
        command = Op(op)
        match command:
            case Op.FORWARD:
                batch = _receive_batch(link, runner.req_to_token, n, bs, k, j, bool(exact))
                hidden = runner.forward(batch)
            case Op.LOGITS:
                assert hidden is not None, "logits before any forward"
                rows = None
                if n >= 0:
                    rows = link.share(torch.empty(n, dtype=torch.int64, device=link.tp.device))
                runner.logits(hidden, rows)
            case Op.STOP:
                return
            case _:
                assert_never(command)


def _receive_batch(
    link: TPLink, pool: ReqToTokenPool, t: int, bs: int, k: int, j: int, exact: bool
) -> ForwardBatch:
    host = link.receive(3 * bs + j)
    seq_lens, prefix_lens, ext_lens = host[:bs], host[bs : 2 * bs], host[2 * bs : 3 * bs]
    journal = host[3 * bs :]
    at = 0
    while at < len(journal):
        row, start, n = journal[at : at + 3]
        pool.write(row, start, torch.tensor(journal[at + 3 : at + 3 + n], dtype=torch.int64))
        at += 3 + n
    values = link.share(torch.empty(3 * t + 4 * bs + k, dtype=torch.int64, device=link.tp.device))
    ids, positions, loc, rows, seq, prefix, ext, logits_rows = values.split(
        [t, t, t, bs, bs, bs, bs, k]
    )
    token_rows = torch.repeat_interleave(rows, ext, output_size=t)
    pool.req_to_token[token_rows, positions] = loc  # (build_batch's scatter on rank 0)
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        out_cache_loc=loc,
        req_pool_indices=rows,
        seq_lens=seq,
        prefix_lens=prefix,
        extend_lens=ext,
        logits_indices=logits_rows,
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=ext_lens,
        exact_lens=exact,
    )
