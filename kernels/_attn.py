"""Shared pieces of the attention kernels: the paged KV layout (torch and Triton) and `dot`.

The paged layout:

    page_size P == 1 (the KVPool today):  slot(row, pos) = req_to_token[row, pos]
    page_size P  > 1:                     slot(row, pos) = req_to_token[row, pos // P] * P + pos % P
                                          (req_to_token then holds page ids, not slots)

    k_buffer[slot], v_buffer[slot] -> [Hkv, D]   (buffers are [num_slots, Hkv, D])

NOTE: slot 0 is reserved and stays zero (runtime/kv_pool.py); with P > 1 that reserves page 0
(slots 0 .. P-1). The kernels read only positions < seq_len of a request: entries past it may be
stale and point at slots that now belong to other requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import check

LOG2E = 1.4426950408889634  # the kernels keep scores in base 2: exp(x) = exp2(x * LOG2E)


def token_slots(req_to_token: torch.Tensor, row: int, seq_len: int, page_size: int) -> torch.Tensor:
    """Slots [seq_len] int64 of positions 0 .. seq_len-1 of the request in `row`."""
    if page_size == 1:
        return req_to_token[row, :seq_len].long()
    pos = torch.arange(seq_len, device=req_to_token.device)
    return req_to_token[row, pos // page_size].long() * page_size + pos % page_size


@triton.jit
def load_slots(table_row, pos, mask, PAGE_SIZE: tl.constexpr):
    """Slots (int64) of positions `pos` of one request; `table_row` points at its req_to_token row.

    Masked-off positions give slot 0 (the reserved zero slot), so a caller that forgets to mask
    its K/V load still reads finite zeros rather than another request's memory.
    """
    if PAGE_SIZE == 1:
        return tl.load(table_row + pos, mask=mask, other=0).to(tl.int64)
    page = tl.load(table_row + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page * PAGE_SIZE + (pos % PAGE_SIZE)


def attention_options(sliding_window: int | None, logit_cap: float | None) -> tuple[int, float]:
    """The kernels' WINDOW and LOGIT_CAP constexprs (0 and 0.0: off) from the wrappers' options.

    NOTE: off must stay 0 / 0.0: the kernels compile their option code under `if WINDOW > 0:` /
    `if LOGIT_CAP > 0:`, so without options they are exactly the kernels without them.
    """
    check(sliding_window is None or sliding_window >= 1, "bad sliding_window {}", sliding_window)
    check(logit_cap is None or logit_cap > 0, "bad logit_cap {}", logit_cap)
    return sliding_window or 0, float(logit_cap or 0.0)


@triton.jit
def softcap(scores, LOGIT_CAP: tl.constexpr):
    """Base-2 scores (natural * log2(e)) capped as LOGIT_CAP * tanh(natural / LOGIT_CAP), in base 2.

    tanh(x) = 1 - 2 / (exp(2x) + 1): right at both ends (exp2 overflows to inf -> 1, or 0 -> -1).
    """
    log2e: tl.constexpr = 1.4426950408889634  # LOG2E (a jit function reads no Python globals)
    cap2 = LOGIT_CAP * log2e  # the cap in base-2 units: x / cap2 = natural / LOGIT_CAP
    return cap2 * (1.0 - 2.0 / (tl.exp2(scores * (2.0 * log2e / cap2)) + 1.0))


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32.

    NOTE: Triton's CPU interpreter (3.9) multiplies the raw bits of bfloat16 operands; the wrappers
    set UPCAST on CPU tensors. Upcasting 16-bit values to fp32 is exact and so are their products
    in fp32 ("ieee"), so both paths compute the same function.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
