"""CUDA graphs for decode steps: one graph per captured batch size, replayed with padding.

A decode step launches ~10 kernels per layer; on the host that costs more than the GPU work at
small batches. Each captured graph runs the whole model (up to the final norm) on static
buffers: a step copies its inputs into the first `bs` rows, points the padded rows at harmless
memory, and replays the graph of the next captured size.

Padded rows: they read row 0 of req_to_token with length 1 (any slot; their outputs are
discarded) and write their K/V to the pool's scratch slot, which no request owns.
The attention split count is fixed at capture time from the context length (see
`TritonAttention.prepare`): splits beyond a request's length are empty and cost one early exit.
A step that verifies drafts replays them too: build_batch lays each draft token out as a
one-token row of its own (`batch_builder.verify_rows_apart`), which a decode graph computes as it
computes any decode row (the K/V of all rows is stored before any row attends).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from weft.runtime.attention import AttentionBackend
from weft.runtime.core import ForwardBatch

logger = logging.getLogger("weft")


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attention: AttentionBackend,
        max_bs: int,
        context_length: int,
        scratch_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attention = attention
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.context_length = context_length
        self.scratch_slot = scratch_slot
        n = self.max_bs
        with torch.device(device):
            # [input_ids, positions, out_cache_loc, req_pool_indices, seq_lens]
            self._inputs = torch.zeros((5, n), dtype=torch.int64)
            self._zeros = torch.zeros(n, dtype=torch.int64)  # prefix_lens: unread in decode
            self._ones = torch.ones(n, dtype=torch.int64)
            self._rows = torch.arange(n, dtype=torch.int64)
        self._pad_from(0)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def _pad_from(self, bs: int, end: int | None = None) -> None:
        """Rows bs..end become padding: length 1 over row 0 of req_to_token, K/V written to the
        scratch slot. NOTE: rows past a batch may hold a larger earlier batch's slots; a stale
        out_cache_loc there would overwrite a live request's KV."""
        _, _, loc, rows, lens = self._inputs
        loc[bs:end].fill_(self.scratch_slot)
        rows[bs:end].zero_()
        lens[bs:end].fill_(1)

    def _static_batch(self, bs: int) -> ForwardBatch:
        ids, pos, loc, rows, lens = (t[:bs] for t in self._inputs)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=rows,
            seq_lens=lens,
            prefix_lens=self._zeros[:bs],
            extend_lens=self._ones[:bs],
            logits_indices=self._rows[:bs],
            # NOTE: host lengths only size the attention splits: the longest possible request
            seq_lens_cpu=[self.context_length] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            exact_lens=False,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # largest first: smaller graphs reuse its memory from the shared pool
        for bs in reversed(self.sizes):
            batch = self._static_batch(bs)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels, settles the allocator
                    self.model(batch, self.attention)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bs] = self.model(batch, self.attention)
            self._graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes 1..%d (%d graphs) in %.1f s",
            self.max_bs,
            len(self.sizes),
            time.perf_counter() - start,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.batch_size <= self.max_bs and batch.is_decode

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.sizes if s >= bs)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [B, hidden] of a decode batch (a view valid until the next replay).

        Every row of a decode batch is a logits row, in order (`build_batch` lays them out so).
        """
        bs = batch.batch_size
        padded = self.padded_size(bs)
        ids, pos, loc, rows, lens = self._inputs
        ids[:bs].copy_(batch.input_ids)
        pos[:bs].copy_(batch.positions)
        loc[:bs].copy_(batch.out_cache_loc)
        rows[:bs].copy_(batch.req_pool_indices)
        lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            self._pad_from(bs, padded)
        self._graphs[padded].replay()
        self.num_replays += 1
        return self._outputs[padded][:bs]
