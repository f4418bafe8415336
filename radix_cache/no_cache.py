"""NoPrefixCache: the naive twin of RadixCache; it never caches anything (ablation, tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import FreeFn, PrefixCache, PrefixMatch


class _NoNode:
    """The dummy handle every match returns; lock/unlock on it do nothing."""

    def __repr__(self) -> str:
        return "<no-cache node>"


class NoPrefixCache(PrefixCache):
    """A prefix cache that is always empty: every match misses, nothing is ever owned.

    NOTE: with this twin the caller keeps ownership of every slot it passes to `insert` and must
    free all of them itself; `insert` neither keeps nor frees any, and `free_fn` is never called.
    """

    enabled = False

    def __init__(self, free_fn: FreeFn) -> None:
        super().__init__(free_fn)
        self._node = _NoNode()

    def match_prefix(self, key: Sequence[int] | torch.Tensor, namespace: str = "") -> PrefixMatch:
        return PrefixMatch(torch.empty(0, dtype=torch.int64), self._node)

    def insert(
        self, key: Sequence[int] | torch.Tensor, slots: torch.Tensor, namespace: str = ""
    ) -> int:
        """Keep nothing and free nothing: all of `slots` stays the caller's to free. Returns 0."""
        if len(key) != slots.numel():
            raise ValueError(f"len(key)={len(key)} != len(slots)={slots.numel()}")
        return 0

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def check_invariants(self) -> None:
        pass

    def pretty(self) -> str:
        return "NoPrefixCache (disabled: holds nothing)"
