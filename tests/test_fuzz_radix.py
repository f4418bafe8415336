"""A stateful hypothesis test of RadixCache over a real KVPool, as the scheduler drives them.

Requests match a prefix, lock it, allocate the rest from the pool (evicting when it runs
short), then insert and unlock, or abort. The reference model is a dict per namespace from
every cached token sequence to the slot of its last token. After every step: free + cached +
in use == the pool's slots, each slot in exactly one place, and the cache's sizes agree with the
model. Matches equal the model's longest cached prefix in the same namespace (so never another
namespace's), and an eviction never takes a locked token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weft.radix_cache import RadixCache
from weft.runtime.kv_pool import KVPool

POOL_SLOTS = 40
Key = tuple[int, ...]

# Shared heads make prompts repeat and overlap, as a server's do.
heads = st.sampled_from([(), (0, 1, 2), (0, 1, 3, 3), (2,)])
tails = st.lists(st.integers(0, 3), max_size=6).map(tuple)
keys = st.builds(lambda head, tail: head + tail, heads, tails).filter(bool)
namespaces = st.sampled_from(["", "a", "b"])


@dataclass
class Request:
    node: object  # the locked handle of its matched prefix
    namespace: str
    key: Key
    cached: list[int]  # slots from the match (the cache's)
    fresh: list[int]  # slots allocated for the rest (the request's)


class RadixOverPool(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(POOL_SLOTS, 1, 1, 1, torch.float32, torch.device("cpu"))
        self.freed: list[int] = []  # what the cache handed back in the current rule
        self.cache = RadixCache(self._cache_frees)
        self.model: dict[str, dict[Key, int]] = {}  # namespace -> sequence -> last slot
        self.requests: list[Request] = []

    def _cache_frees(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())
        self.pool.free(slots)

    # ---- the model ------------------------------------------------------------------------

    def cached_prefix(self, namespace: str, key: Key) -> list[int]:
        entries = self.model.get(namespace, {})
        slots = []
        while len(slots) < len(key) and key[: len(slots) + 1] in entries:
            slots.append(entries[key[: len(slots) + 1]])
        return slots

    def locked(self) -> set[tuple[str, Key]]:
        """Every cached sequence a running request holds a lock on (its prefixes included)."""
        return {
            (r.namespace, r.key[:i]) for r in self.requests for i in range(1, len(r.cached) + 1)
        }

    @property
    def in_use(self) -> int:
        return sum(len(r.fresh) for r in self.requests)

    def evict(self, num_tokens: int) -> None:
        locked = self.locked()
        evictable = sum(len(e) for e in self.model.values()) - len(locked)
        self.freed = []
        got = self.cache.evict(num_tokens)
        assert got == len(self.freed) >= min(num_tokens, evictable)
        by_slot = {s: (ns, seq) for ns, e in self.model.items() for seq, s in e.items()}
        for slot in self.freed:
            ns, seq = by_slot[slot]  # a KeyError: it freed a slot it did not hold
            assert (ns, seq) not in locked, f"evicted locked {seq} in {ns!r}"
            del self.model[ns][seq]
        for ns, entries in self.model.items():  # leaves went first: still prefix-closed
            assert all(seq[:-1] in entries for seq in entries if len(seq) > 1), ns

    # ---- rules ----------------------------------------------------------------------------

    @rule(ns=namespaces, key=keys | st.just(()))
    def match(self, ns: str, key: Key) -> None:
        m = self.cache.match_prefix(list(key), namespace=ns)
        assert m.slots.tolist() == self.cached_prefix(ns, key)

    @precondition(lambda self: len(self.requests) < 5)
    @rule(ns=namespaces, key=keys)
    def start_request(self, ns: str, key: Key) -> None:
        m = self.cache.match_prefix(list(key), namespace=ns)
        cached = m.slots.tolist()
        assert cached == self.cached_prefix(ns, key)
        self.cache.lock(m.node)
        need = len(key) - len(cached)
        if not self.pool.can_allocate(need):
            self.evict(need - self.pool.num_free)
        if not self.pool.can_allocate(need):  # too much is locked: the request waits
            self.cache.unlock(m.node)
            return
        fresh = self.pool.allocate(need).tolist()
        self.requests.append(Request(m.node, ns, key, cached, fresh))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10))
    def finish_request(self, i: int) -> None:
        req = self.requests.pop(i % len(self.requests))
        slots = req.cached + req.fresh
        already = len(self.cached_prefix(req.namespace, req.key))
        prefix = self.cache.insert(
            req.key, torch.tensor(slots, dtype=torch.int64), namespace=req.namespace
        )
        assert prefix == already >= len(req.cached)  # the locked prefix is still there
        entries = self.model.setdefault(req.namespace, {})
        for n in range(prefix + 1, len(req.key) + 1):
            entries[req.key[:n]] = slots[n - 1]
        # fresh slots for tokens another request cached meanwhile are the caller's to free
        duplicates = slots[len(req.cached) : prefix]
        self.pool.free(torch.tensor(duplicates, dtype=torch.int64))
        self.cache.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10))
    def abort_request(self, i: int) -> None:
        req = self.requests.pop(i % len(self.requests))
        self.pool.free(torch.tensor(req.fresh, dtype=torch.int64))
        self.cache.unlock(req.node)

    @rule(n=st.integers(0, 12))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self) -> None:
        self.freed = []
        self.cache.reset()
        assert sorted(self.freed) == sorted(s for e in self.model.values() for s in e.values())
        self.model.clear()

    # ---- after every step -----------------------------------------------------------------

    @invariant()
    def slots_add_up(self) -> None:
        self.cache.check_invariants()
        cached = sum(len(e) for e in self.model.values())
        assert self.cache.total_size == cached
        assert self.cache.protected_size == len(self.locked())
        assert self.pool.num_free + self.cache.total_size + self.in_use == POOL_SLOTS
        places = [
            self.pool.free_slots().tolist(),
            [s for e in self.model.values() for s in e.values()],
            [s for r in self.requests for s in r.fresh],
        ]
        everywhere = [s for place in places for s in place]
        assert sorted(everywhere) == list(range(1, POOL_SLOTS + 1))  # each slot once

    @invariant()
    def namespaces_do_not_share(self) -> None:
        for ns, entries in self.model.items():
            others = [e for other, e in self.model.items() if other != ns]
            assert all(set(entries.values()).isdisjoint(e.values()) for e in others)


RadixOverPool.TestCase.settings = settings(
    max_examples=75, stateful_step_count=40, deadline=None, database=None
)
TestRadixOverPool = RadixOverPool.TestCase
