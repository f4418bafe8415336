"""TorchAttention's decode with a sliding window: it gathers only the window's positions and
attends exactly as the whole-context masked path (`decode_attention_ref`) does."""

from __future__ import annotations

import math

import pytest
import torch

from weft.kernels.decode_attention import decode_attention_ref
from weft.runtime.attention import AttentionOptions, TorchAttention
from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import KVPool, ReqToTokenPool

WINDOW = 8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
STALE = 4  # NaN-filled slots past each request's length (stale slots of finished requests)


def _decode_step(seq_lens: list[int]) -> tuple[KVPool, ReqToTokenPool, ForwardBatch]:
    """A pool holding random float64 KV for every position of each request (the last one is this
    step's token), over shuffled slots, and the decode batch of those requests."""
    g = torch.Generator().manual_seed(sum(seq_lens))
    device = torch.device("cpu")
    pool = KVPool(
        sum(seq_lens) + STALE * len(seq_lens) + 1, 1, KV_HEADS, HEAD_DIM, torch.float64, device
    )
    table = ReqToTokenPool(len(seq_lens) + 2, max(seq_lens) + STALE, device)
    table.allocate()  # leave row 0 unused: rows need not start at 0
    all_slots = pool.allocate(pool.size)[torch.randperm(pool.size, generator=g)]
    rows, last, used = [], [], 0
    for seq in seq_lens:
        row = table.allocate()
        slots, junk = all_slots[used : used + seq], all_slots[used + seq : used + seq + STALE]
        used += seq + STALE
        table.write(row, 0, torch.cat([slots, junk]))
        for buf in (pool.k_buffers[0], pool.v_buffers[0]):
            buf[slots] = torch.randn((seq, KV_HEADS, HEAD_DIM), dtype=torch.float64, generator=g)
            buf[junk] = float("nan")
        rows.append(row)
        last.append(int(slots[-1]))
    n = len(seq_lens)
    batch = ForwardBatch(
        input_ids=torch.ones(n, dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1,
        out_cache_loc=torch.tensor(last),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        prefix_lens=torch.tensor(seq_lens) - 1,
        extend_lens=torch.ones(n, dtype=torch.int64),
        logits_indices=torch.arange(n),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=[s - 1 for s in seq_lens],
        extend_lens_cpu=[1] * n,
    )
    return pool, table, batch


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize(
    "seq_lens",
    [
        [3, WINDOW, WINDOW + 13, 5 * WINDOW],  # shorter, equal to and longer than the window
        [1, WINDOW - 1],  # every context inside the window: the whole-context gather
    ],
)
def test_windowed_decode_matches_whole_context_and_reads_only_the_window(seq_lens, cap):
    pool, table, batch = _decode_step(seq_lens)
    k_buf, v_buf = pool.k_buffers[0], pool.v_buffers[0]
    q = torch.randn((len(seq_lens), HEADS, HEAD_DIM), dtype=torch.float64)
    k, v = k_buf[batch.out_cache_loc].clone(), v_buf[batch.out_cache_loc].clone()
    # the whole context, masked outside the window (before any poisoning)
    want = decode_attention_ref(
        q,
        k_buf,
        v_buf,
        table.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        1 / math.sqrt(HEAD_DIM),
        sliding_window=WINDOW,
        logit_cap=cap,
    )
    # NaN in the K/V before each window: a masked read would still turn the output NaN
    los = [max(0, s - WINDOW) for s in seq_lens]
    for row, lo in zip(batch.req_pool_indices.tolist(), los, strict=True):
        before = table.req_to_token[row, :lo]
        k_buf[before] = float("nan")
        v_buf[before] = float("nan")

    backend = TorchAttention(pool, table)
    backend.prepare(batch)
    got = backend.forward(
        q, k, v, 0, batch, options=AttentionOptions(sliding_window=WINDOW, logit_cap=cap)
    )

    assert got.shape == (len(seq_lens), HEADS * HEAD_DIM)
    torch.testing.assert_close(got.view(-1, HEADS, HEAD_DIM), want, rtol=1e-12, atol=1e-12)
    slots, keep = backend._decode_view(WINDOW, batch)
    assert slots.shape == (len(seq_lens), min(WINDOW, max(seq_lens)))  # the window's width only
    for b, (row, lo, seq) in enumerate(
        zip(batch.req_pool_indices.tolist(), los, seq_lens, strict=True)
    ):
        assert slots[b][keep[b, 0, 0]].tolist() == table.req_to_token[row, lo:seq].tolist()
        assert slots[b][~keep[b, 0, 0]].tolist() == [0] * (slots.shape[1] - (seq - lo))
    # the same step's full-attention layers still gather the whole context
    full_slots, _ = backend._decode_view(None, batch)
    assert full_slots.shape == (len(seq_lens), max(seq_lens))
