"""The interface every grammar backend implements.

A backend compiles a `GrammarSpec` once (the result is cached and shared); each request gets its
own `Matcher` over the compiled grammar. The matcher writes the allowed tokens of the next
position into one row of the int32 token bitmask (bit set = allowed; grammars/bitmask.py holds
the layout and its helpers).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import torch

from weft.grammars.spec import GrammarSpec
from weft.grammars.vocab import TokenVocab

# Threads a backend fills a batch of rows with (xgrammar's and llguidance's pools, each
# parallel over rows, native code without the GIL).
FILL_THREADS = min(8, os.cpu_count() or 1)
# Threads one compile may take (xgrammar's token-mask cache): half the cores, as a compile runs
# beside the decoding steps (on a 2-core CPU the default 8 took both cores from the forward for
# seconds: plain requests' p99 latency went from 0.85 to 6.6 s under compile traffic).
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


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

    def fill_many(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill rows[i] for matchers[i] (a backend with a parallel batch fill overrides it)."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)

    def can_end_many(
        self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]
    ) -> list[bool]:
        """can_end of each matcher at its filled row."""
        return [m.can_end(bitmask, row) for m, row in zip(matchers, rows, strict=True)]
