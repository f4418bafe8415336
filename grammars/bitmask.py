"""The token bitmask ABI: int32 `[rows, W]`, W = ceil(vocab / 32); token t is allowed iff bit
t % 32 of word t // 32 is set (the layout xgrammar, llguidance and outlines-core share).

Matchers fill it on the host (grammars/); the samplers read it on the logits' device (the fused
kernel in kernels/masked_sample.py and its torch twin). Size it by the model's vocabulary (lm_head
rows), not the tokenizer's. A token at or past 32 * W is never allowed; bits past the vocabulary
are ignored.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def set_bits_rows(
    bitmask: torch.Tensor, rows: list[int], ids: list[int], allowed: list[bool]
) -> None:
    """For each rows[i]: set the bits of `ids` if allowed[i], else clear them (vectorized over the
    rows: this runs for every constrained row of every step)."""
    if not rows or not ids:
        return
    words = bitmask.numpy()
    flags = np.asarray(allowed, dtype=bool)
    index = np.asarray(rows, dtype=np.int64)
    on, off = index[flags], index[~flags]
    for tid in ids:  # NOTE: one id at a time: two ids may share a word
        word, bit = divmod(tid, 32)
        mask = np.int32(np.uint32(1 << bit).view(np.int32))
        words[on, word] |= mask
        words[off, word] &= ~mask


def bit_is_set(bitmask: torch.Tensor, row: int, tid: int) -> bool:
    word, bit = divmod(tid, 32)
    return bool((int(bitmask.numpy()[row, word]) >> bit) & 1)


def bits_set(bitmask: torch.Tensor, rows: list[int], tid: int) -> list[bool]:
    """bit_is_set for several rows of a CPU bitmask at once."""
    word, bit = divmod(tid, 32)
    values = bitmask.numpy()[np.asarray(rows, dtype=np.int64), word]
    return ((values >> bit) & 1).astype(bool).tolist()


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids whose bit is set (for tests and debugging)."""
    allowed = allowed_tokens(bitmask[row : row + 1], None, vocab_size)
    assert allowed is not None
    return [int(i) for i in torch.nonzero(allowed[0])[:, 0]]


def allowed_tokens(
    bitmask: torch.Tensor | None, constrained: torch.Tensor | None, vocab: int
) -> torch.Tensor | None:
    """The allowed set [B, V] bool of each row (None: all tokens of every row). constrained [B]
    bool: the rows the bitmask applies to (None: every row)."""
    if bitmask is None:
        return None
    batch, num_words = bitmask.shape
    used = min(num_words, bitmask_width(vocab))
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :used, None] >> shifts) & 1  # [B, used, 32]; bit j: token 32 w + j
    allowed = bits.view(batch, 32 * used)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # tokens at or past 32 * W: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    if constrained is not None:
        allowed |= ~constrained[:, None]
    return allowed


def count_allowed(
    bitmask: torch.Tensor, constrained: torch.Tensor | None, vocab: int
) -> torch.Tensor:
    """The allowed tokens per row [B] int64, by a popcount of the bitmask's bytes (a sum over
    `allowed_tokens` costs ~10x); an unconstrained row counts the whole vocabulary."""
    words = bitmask[:, : min(bitmask.shape[1], bitmask_width(vocab))]
    if words.shape[1] * 32 > vocab:  # the last word's bits past V are no tokens
        words = words.clone()
        words[:, -1] &= (1 << (vocab % 32)) - 1
    byte_values = torch.arange(256, device=bitmask.device)
    ones = torch.zeros_like(byte_values)  # popcount of each byte value
    for b in range(8):
        ones += (byte_values >> b) & 1
    count = ones[words.contiguous().view(torch.uint8).long()].sum(-1)
    if constrained is not None:
        count = torch.where(constrained, count, vocab)
    return count
