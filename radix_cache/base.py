"""The prefix-cache interface the scheduler is written against.

KV memory is a pool of token slots (int ids). A prefix cache maps token-id sequences to the slots
that hold their KV, so a request whose prompt starts like an earlier one skips that prefill. The
cache OWNS every slot inserted into it until it evicts it, at which point the slot goes back to
the pool through `free_fn`. Page size is one token.

Slot ownership across `insert(key, slots)` returning `prefix`:

| range               | owner after the call                                               |
|---------------------|--------------------------------------------------------------------|
| `slots[prefix:]`    | the cache (it holds them for `key[prefix:]`)                       |
| `slots[:prefix]`    | the caller: the cache keeps its OWN slots for `key[:prefix]`; the  |
|                     | caller frees the ones that duplicate them (not the ones it got     |
|                     | from `match_prefix`, which are the cache's)                        |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

FreeFn = Callable[[torch.Tensor], None]
"""Receives an int64 1-D CPU tensor of slots to give back to the pool."""


@dataclass
class PrefixMatch:
    """The longest cached prefix of a key.

    `node` is an opaque handle of the deepest matched node: pass it to `lock` / `unlock`. With no
    match it is the namespace's root (locking it protects nothing and is harmless).
    """

    slots: torch.Tensor  # int64 [length], CPU; a fresh tensor the caller may keep or modify
    node: object

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class PrefixCache(ABC):
    """A map from token-id prefixes to KV slots, with LRU eviction of unlocked entries.

    Namespaces (tenant / cache salt) isolate entries completely: a match in one namespace never
    returns slots inserted under another. Sizes and eviction are global across namespaces.
    """

    enabled: bool = True

    def __init__(self, free_fn: FreeFn) -> None:
        self.free_fn = free_fn

    @abstractmethod
    def match_prefix(self, key: Sequence[int] | torch.Tensor, namespace: str = "") -> PrefixMatch:
        """Longest cached prefix of `key` in `namespace`; refreshes LRU time along its path."""

    @abstractmethod
    def insert(
        self, key: Sequence[int] | torch.Tensor, slots: torch.Tensor, namespace: str = ""
    ) -> int:
        """Cache `key -> slots` (same length); return how many leading tokens were already cached.

        See the module docstring for who owns which slots afterwards.
        """

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect `node` and its ancestors from eviction (a counted reference)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one `lock(node)` on the same handle; raises RuntimeError if there is none."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible, least recently used leaves first.

        Returns the number of slots handed to `free_fn` (less than asked if too much is locked).
        """

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, freeing all slots; only valid while nothing is locked."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held in locked nodes."""

    @property
    def total_size(self) -> int:
        """Number of slots the cache owns."""
        return self.evictable_size + self.protected_size

    @abstractmethod
    def check_invariants(self) -> None:
        """Audit the structure and the counters; raise AssertionError with a message if broken."""

    @abstractmethod
    def pretty(self) -> str:
        """A readable dump for debugging."""
