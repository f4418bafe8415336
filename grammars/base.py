"""The interface every grammar backend implements.

A backend compiles a `GrammarSpec` once (the result is cached and shared); each request gets its
own `Matcher` over the compiled grammar. The matcher writes the allowed tokens of the next
position into one row of an int32 bitmask `[batch, ceil(vocab / 32)]` (bit set = allowed; the
layout xgrammar, llguidance and outlines-core share).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from weft.grammars.spec import GrammarSpec
from weft.grammars.vocab import TokenVocab


class GrammarUnsupported(Exception):
    """This backend cannot serve this spec (a feature it lacks): the next backend may."""


class Matcher(ABC):
    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (CPU int32)."""

    @abstractmethod
    def can_end(self, bitmask: torch.Tensor, row: int) -> bool:
        """Whether the output may end here (called right after fill_bitmask on that row)."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (an end token was accepted, or nothing can follow)."""

    def jump_forward(self) -> bytes:
        """The bytes the grammar forces next (b"" when there is a choice)."""
        return b""


class GrammarBackend(ABC):
    name: str

    def __init__(self, vocab: TokenVocab, compact_json: bool = False) -> None:
        """compact_json: JSON under a schema on one line, with ", " and ": " (not whitespace as
        the model writes it, spec.JSON_WHITESPACE)."""
        self.vocab = vocab
        self.compact_json = compact_json

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """-> the compiled grammar. Raises InvalidSpec (the spec is wrong) or
        GrammarUnsupported (this backend cannot do it)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the grammar."""


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


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids whose bit is set (for tests and debugging)."""
    from weft.kernels.masked_sample import allowed_tokens

    allowed = allowed_tokens(bitmask[row : row + 1], None, vocab_size)
    assert allowed is not None
    return [int(i) for i in torch.nonzero(allowed[0])[:, 0]]
