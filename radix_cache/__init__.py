"""Prefix caches over token ids -> KV slots: the radix tree and its no-cache twin."""

from __future__ import annotations

from .base import FreeFn, PrefixCache, PrefixMatch
from .no_cache import NoPrefixCache
from .radix_tree import RadixCache

__all__ = ["FreeFn", "NoPrefixCache", "PrefixCache", "PrefixMatch", "RadixCache"]
