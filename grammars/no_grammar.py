"""The no-grammar twin: every token allowed, nothing ever forced. It runs the whole constrained
path (masks filled, applied, tokens accepted) at no grammar cost: a benchmark baseline and a test
double for the mask plumbing."""

from __future__ import annotations

from typing import Any

import torch

from weft.grammars.base import GrammarBackend, Matcher
from weft.grammars.spec import GrammarSpec


class AnyTextMatcher(Matcher):
    def __init__(self) -> None:
        self.accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(-1)

    def can_end(self, bitmask: torch.Tensor, row: int) -> bool:
        return True

    def accept(self, token: int) -> bool:
        self.accepted += 1
        return True

    def rollback(self, n: int) -> None:
        self.accepted -= n

    def is_terminated(self) -> bool:
        return False


class NoGrammarBackend(GrammarBackend):
    name = "none"

    def compile(self, spec: GrammarSpec) -> Any:
        return spec

    def matcher(self, compiled: Any) -> Matcher:
        return AnyTextMatcher()
