"""RadixCache and its NoPrefixCache twin: exact unit tests and a stateful model check."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weft.radix_cache import NoPrefixCache, PrefixCache, PrefixMatch, RadixCache


class Pool:
    """Stands in for the KV pool: records every free_fn call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1 and slots.device.type == "cpu"
        self.calls.append(slots.tolist())

    @property
    def freed(self) -> list[int]:
        return [s for call in self.calls for s in call]


def make() -> tuple[RadixCache, Pool]:
    pool = Pool()
    return RadixCache(pool.free), pool


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def sizes(cache: PrefixCache) -> tuple[int, int, int]:
    return cache.evictable_size, cache.protected_size, cache.total_size


# ---- unit tests ---------------------------------------------------------------------------


def test_match_on_empty_cache() -> None:
    cache, pool = make()
    m = cache.match_prefix([1, 2, 3])
    assert isinstance(m, PrefixMatch)
    assert m.length == 0
    assert m.slots.dtype == torch.int64 and m.slots.shape == (0,)
    assert cache.match_prefix([]).length == 0
    cache.lock(m.node)  # an empty match is lockable and protects nothing
    assert sizes(cache) == (0, 0, 0)
    cache.unlock(m.node)
    assert cache.evict(10) == 0
    assert pool.calls == []
    cache.check_invariants()


def test_insert_then_match_full_partial_divergent() -> None:
    cache, pool = make()
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    assert sizes(cache) == (4, 0, 4)
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2]).slots.tolist() == [10, 11]
    assert cache.match_prefix([1, 2, 9, 4]).slots.tolist() == [10, 11]
    assert cache.match_prefix([2, 3]).length == 0
    assert cache.match_prefix(torch.tensor([1, 2, 3])).slots.tolist() == [10, 11, 12]
    assert sizes(cache) == (4, 0, 4)  # matching moves no slot
    assert pool.calls == []
    cache.check_invariants()


def test_match_result_is_a_copy() -> None:
    cache, _ = make()
    cache.insert([1, 2], slots(10, 11))
    cache.match_prefix([1, 2]).slots[0] = 99
    assert cache.match_prefix([1, 2]).slots.tolist() == [10, 11]


def test_insert_copies_caller_tensors() -> None:
    cache, _ = make()
    key, s = torch.tensor([1, 2, 3]), slots(10, 11, 12)
    cache.insert(key, s)
    key[0], s[0] = 7, 70
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]


def test_match_ending_mid_edge_splits_the_node() -> None:
    cache, pool = make()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    m = cache.match_prefix([1, 2, 7])
    assert m.slots.tolist() == [10, 11]
    cache.check_invariants()
    assert "[1, 2] (2 tok)" in cache.pretty() and "[3, 4] (2 tok)" in cache.pretty()
    # The handle covers exactly the matched 2 tokens: locking it protects those, not [3, 4].
    cache.lock(m.node)
    assert sizes(cache) == (2, 2, 4)
    assert cache.evict(100) == 2
    assert pool.calls == [[12, 13]]
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11]
    cache.unlock(m.node)
    assert sizes(cache) == (2, 0, 2)
    cache.check_invariants()


def test_split_keeps_the_lock_of_a_deeper_handle() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    deep = cache.match_prefix([1, 2, 3, 4])
    cache.lock(deep.node)
    cache.match_prefix([1, 2])  # splits the locked edge above the handle
    cache.check_invariants()
    assert sizes(cache) == (0, 4, 4)
    assert cache.evict(4) == 0
    cache.unlock(deep.node)
    assert sizes(cache) == (4, 0, 4)
    cache.check_invariants()


def test_insert_with_shared_prefix_returns_prefix_and_keeps_own_slots() -> None:
    cache, pool = make()
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 0
    # [1, 2] is already cached: the cache keeps 10, 11; 20, 21 stay the caller's.
    assert cache.insert([1, 2, 5, 6], slots(20, 21, 22, 23)) == 2
    assert sizes(cache) == (5, 0, 5)
    assert cache.match_prefix([1, 2, 5, 6]).slots.tolist() == [10, 11, 22, 23]
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]
    # Fully cached key (also a key ending mid-edge): nothing new is owned.
    assert cache.insert([1, 2, 5, 6], slots(30, 31, 32, 33)) == 4
    assert cache.insert([1], slots(40)) == 1
    assert cache.insert([], slots()) == 0
    assert sizes(cache) == (5, 0, 5)
    assert pool.calls == []
    assert cache.evict(100) == 5
    assert sorted(pool.freed) == [10, 11, 12, 22, 23]
    assert sizes(cache) == (0, 0, 0)
    cache.check_invariants()


def test_insert_rejects_length_mismatch() -> None:
    cache, _ = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], slots(10, 11))


def test_lock_protects_from_eviction() -> None:
    cache, pool = make()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([4, 5], slots(20, 21))
    held = cache.match_prefix([1, 2, 3])
    cache.lock(held.node)
    cache.lock(held.node)  # two requests share it
    assert sizes(cache) == (2, 3, 5)
    assert cache.evict(5) == 2  # fewer than asked: the rest is locked
    assert pool.calls == [[20, 21]]
    cache.unlock(held.node)
    assert cache.evict(5) == 0
    assert sizes(cache) == (0, 3, 3)
    cache.unlock(held.node)
    assert sizes(cache) == (3, 0, 3)
    assert cache.evict(1) == 3  # the whole leaf goes
    assert pool.calls == [[20, 21], [10, 11, 12]]
    cache.check_invariants()


def test_locking_a_node_protects_its_ancestors() -> None:
    cache, _ = make()
    cache.insert([1, 2], slots(10, 11))
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    cache.lock(cache.match_prefix([1, 2, 3, 4]).node)
    assert sizes(cache) == (0, 4, 4)
    assert cache.evict(1) == 0


def test_unlock_below_zero_raises() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    node = cache.match_prefix([1, 2, 3]).node
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    assert sizes(cache) == (3, 0, 3)
    # An ancestor locked only through its child has no lock of its own to give back.
    cache.lock(node)
    upper = cache.match_prefix([1]).node
    with pytest.raises(RuntimeError):
        cache.unlock(upper)
    assert sizes(cache) == (0, 3, 3)
    cache.check_invariants()


def test_lock_on_evicted_node_raises() -> None:
    cache, _ = make()
    cache.insert([1, 2], slots(10, 11))
    node = cache.match_prefix([1, 2]).node
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.lock(node)
    with pytest.raises(TypeError):
        cache.lock(object())


def test_eviction_is_lru_over_leaves_and_parents_become_leaves() -> None:
    cache, pool = make()
    cache.insert([1, 2, 3], slots(13, 12, 11))  # t1
    cache.insert([1, 2, 4], slots(0, 0, 14))  # t2: [1, 2] -> {[3], [4]}
    cache.insert([5, 6], slots(15, 16))  # t3
    cache.match_prefix([1, 2, 3])  # t4: refreshes [1, 2] and [3], not [4]
    cache.insert([7], slots(17))  # t5
    assert sizes(cache) == (7, 0, 7)
    # Leaves by age: [4] t2, [5, 6] t3, [3] t4; then [1, 2] (t4, a leaf once [3] is gone)
    # goes before [7] t5, although it was an inner node when the evictions began.
    expected = [[14], [15, 16], [11], [13, 12], [17]]
    for want in expected:
        assert cache.evict(1) == len(want)
        assert pool.calls[-1] == want
        cache.check_invariants()
    assert cache.evict(1) == 0
    assert len(pool.calls) == len(expected)  # no empty free_fn call
    assert sizes(cache) == (0, 0, 0)


def test_evict_batches_free_calls_and_stops_once_enough() -> None:
    cache, pool = make()
    for i in range(5):
        cache.insert([i, 9], slots(10 * i, 10 * i + 1))
    assert cache.evict(3) == 4  # two whole leaves, oldest first
    assert pool.calls == [[0, 1, 10, 11]]
    assert cache.evict(0) == 0
    assert cache.evict(100) == 6
    assert len(pool.calls) == 2
    assert sorted(pool.freed) == [0, 1, 10, 11, 20, 21, 30, 31, 40, 41]


def test_insert_refreshes_lru() -> None:
    cache, pool = make()
    cache.insert([1], slots(10))
    cache.insert([2], slots(20))
    assert cache.insert([1], slots(99)) == 1  # touches [1]
    assert cache.evict(1) == 1
    assert pool.calls == [[20]]


def test_namespaces_isolate_and_share_accounting() -> None:
    cache, pool = make()
    cache.insert([1, 2, 3], slots(10, 11, 12), namespace="a")
    cache.insert([1, 2, 3], slots(20, 21, 22), namespace="b")
    assert cache.match_prefix([1, 2, 3], namespace="a").slots.tolist() == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3], namespace="b").slots.tolist() == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="c").length == 0
    assert cache.insert([1, 2], slots(30, 31), namespace="") == 0  # no cross-namespace prefix
    assert sizes(cache) == (8, 0, 8)
    # LRU is global: "a" was touched before "b", "b" before "".
    held = cache.match_prefix([1, 2], namespace="")
    cache.lock(held.node)
    assert cache.evict(1) == 3
    assert pool.calls == [[10, 11, 12]]
    assert cache.match_prefix([1, 2, 3], namespace="a").length == 0
    assert cache.evict(100) == 3
    assert pool.calls[-1] == [20, 21, 22]
    assert sizes(cache) == (0, 2, 2)
    cache.unlock(held.node)
    assert sizes(cache) == (2, 0, 2)
    cache.check_invariants()
    assert "namespace ''" in cache.pretty() and "'b'" not in cache.pretty()


def test_reset_frees_everything() -> None:
    cache, pool = make()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(20, 21, 14))
    cache.insert([1], slots(30), namespace="x")
    node = cache.match_prefix([1, 2, 4]).node
    cache.lock(node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert len(pool.calls) == 1
    assert sorted(pool.freed) == [10, 11, 12, 14, 30]
    assert sizes(cache) == (0, 0, 0)
    assert cache.match_prefix([1, 2, 3]).length == 0
    cache.check_invariants()
    cache.reset()  # empty: no free_fn call
    assert len(pool.calls) == 1


def test_check_invariants_catches_a_slot_held_twice() -> None:
    cache, _ = make()
    cache.insert([1], slots(5), namespace="a")
    cache.insert([2], slots(5), namespace="b")  # a caller bug: one slot given twice
    with pytest.raises(AssertionError, match="held twice"):
        cache.check_invariants()


def test_long_keys_and_deep_paths() -> None:
    cache, pool = make()
    n = 50_000
    key = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0))
    cache.insert(key, torch.arange(n))
    other = key.clone()
    other[30_000] = 1001
    assert cache.insert(other, torch.arange(n, 2 * n)) == 30_000
    assert torch.equal(cache.match_prefix(other).slots[30_000:], torch.arange(n + 30_000, 2 * n))
    assert cache.total_size == 2 * n - 30_000
    # Deeper than Python's recursion limit: each match splits off one token from the bottom.
    depth = 1_100
    chain = list(range(2000, 2000 + depth))
    cache.insert(chain, torch.arange(3 * n, 3 * n + depth))
    for end in range(depth - 1, 0, -1):
        assert cache.match_prefix(chain[:end]).length == end
    cache.check_invariants()
    assert len(cache.pretty().splitlines()) > depth
    cache.reset()
    assert len(pool.freed) == 2 * n - 30_000 + depth


def test_no_prefix_cache_twin() -> None:
    pool = Pool()
    cache = NoPrefixCache(pool.free)
    assert cache.enabled is False and RadixCache(pool.free).enabled is True
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.slots.dtype == torch.int64
    cache.lock(m.node)
    cache.unlock(m.node)
    cache.unlock(m.node)  # no-op, never raises
    assert cache.evict(10) == 0
    assert sizes(cache) == (0, 0, 0)
    cache.reset()
    cache.check_invariants()
    assert pool.calls == []  # insert kept nothing and freed nothing: all slots stay the caller's
    assert "NoPrefixCache" in cache.pretty()


# ---- stateful model check -----------------------------------------------------------------

Key = tuple[int, ...]


@dataclass
class Entry:
    slot: int
    time: int
    locks: int = 0
    ends_edge: bool = False  # the tree has a node boundary right after this token


class Reference:
    """Token-level model: every cached prefix maps to one slot, with its own time and locks.

    The tree evicts whole edges, the model one token at a time. The orders agree because all
    tokens of an edge share one access time and no two leaf tokens share a time (one call stamps
    one path); the model knows where edges end (keys end there, and inserts and matches split
    there), so it can stop where the tree stops: once enough is freed, at an edge's first token.
    """

    def __init__(self) -> None:
        self.entries: dict[tuple[str, Key], Entry] = {}
        self.clock = 0

    def match(self, ns: str, key: Key) -> list[int]:
        self.clock += 1
        out = []
        for i in range(1, len(key) + 1):
            entry = self.entries.get((ns, key[:i]))
            if entry is None:
                break
            entry.time = self.clock
            out.append(entry.slot)
        if out:
            self.entries[(ns, key[: len(out)])].ends_edge = True
        return out

    def insert(self, ns: str, key: Key, slots: list[int]) -> int:
        self.clock += 1
        prefix = 0
        for i in range(1, len(key) + 1):
            entry = self.entries.get((ns, key[:i]))
            if entry is None:
                self.entries[(ns, key[:i])] = Entry(slots[i - 1], self.clock)
            else:
                assert prefix == i - 1
                prefix = i
                entry.time = self.clock
        for end in (prefix, len(key)):
            if end:
                self.entries[(ns, key[:end])].ends_edge = True
        return prefix

    def lock(self, ns: str, prefix: Key, delta: int) -> None:
        for i in range(1, len(prefix) + 1):
            self.entries[(ns, prefix[:i])].locks += delta

    def evict(self, want: int) -> list[int]:
        freed: list[int] = []
        while True:
            inner = {(ns, key[:-1]) for ns, key in self.entries}
            leaves = sorted(
                (entry.time, k)
                for k, entry in self.entries.items()
                if entry.locks == 0 and k not in inner
            )
            if not leaves:
                return freed
            assert len(leaves) == 1 or leaves[0][0] < leaves[1][0], "LRU tie in the model"
            ns, key = leaves[0][1]
            freed.append(self.entries.pop((ns, key)).slot)
            parent = self.entries.get((ns, key[:-1]))
            if len(freed) >= want and (parent is None or parent.ends_edge):
                return freed

    @property
    def held(self) -> set[int]:
        return {entry.slot for entry in self.entries.values()}

    @property
    def evictable(self) -> int:
        return sum(1 for entry in self.entries.values() if entry.locks == 0)

    @property
    def protected(self) -> int:
        return sum(1 for entry in self.entries.values() if entry.locks > 0)


keys = st.lists(st.integers(0, 3), max_size=12).map(tuple)
namespaces = st.sampled_from(["", "b"])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(self.on_free)
        self.ref = Reference()
        self.next_slot = 0
        self.freed_by_cache: set[int] = set()
        self.freed_by_caller: set[int] = set()
        self.last_freed: list[int] = []
        self.locks: list[tuple[object, str, Key]] = []
        # Requests between "prefix matched and locked" and "prefill done, inserted".
        self.requests: list[tuple[object, str, Key, list[int]]] = []

    def on_free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        for s in slots.tolist():
            assert s not in self.freed_by_cache and s not in self.freed_by_caller, f"{s} twice"
            self.freed_by_cache.add(s)
            self.last_freed.append(s)

    def caller_frees(self, slots: list[int]) -> None:
        for s in slots:
            assert s not in self.freed_by_cache and s not in self.freed_by_caller, f"{s} twice"
            self.freed_by_caller.add(s)

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def match(self, ns: str, key: Key) -> PrefixMatch:
        m = self.cache.match_prefix(list(key), namespace=ns)
        assert m.slots.tolist() == self.ref.match(ns, key)
        return m

    @rule(ns=namespaces, key=keys)
    def insert(self, ns: str, key: Key) -> None:
        new = self.fresh(len(key))
        prefix = self.cache.insert(key, torch.tensor(new, dtype=torch.int64), namespace=ns)
        assert prefix == self.ref.insert(ns, key, new)
        self.caller_frees(new[:prefix])  # duplicates of what the cache already holds

    @rule(ns=namespaces, key=keys)
    def match_only(self, ns: str, key: Key) -> None:
        self.match(ns, key)

    @rule(ns=namespaces, key=keys)
    def match_and_lock(self, ns: str, key: Key) -> None:
        m = self.match(ns, key)
        self.cache.lock(m.node)
        self.ref.lock(ns, key[: m.length], +1)
        self.locks.append((m.node, ns, key[: m.length]))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 50))
    def unlock(self, i: int) -> None:
        node, ns, prefix = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)
        self.ref.lock(ns, prefix, -1)

    @precondition(lambda self: len(self.requests) < 4)
    @rule(ns=namespaces, key=keys)
    def start_request(self, ns: str, key: Key) -> None:
        m = self.match(ns, key)
        self.cache.lock(m.node)
        self.ref.lock(ns, key[: m.length], +1)
        self.requests.append((m.node, ns, key, m.slots.tolist()))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50))
    def finish_request(self, i: int) -> None:
        # The scheduler's flow: cached slots from the match + fresh ones for the rest.
        node, ns, key, cached = self.requests.pop(i % len(self.requests))
        full = cached + self.fresh(len(key) - len(cached))
        prefix = self.cache.insert(key, torch.tensor(full, dtype=torch.int64), namespace=ns)
        assert prefix == self.ref.insert(ns, key, full)
        assert prefix >= len(cached)  # the locked prefix cannot have gone
        self.caller_frees(full[len(cached) : prefix])  # fresh ones that turned out duplicates
        self.cache.unlock(node)
        self.ref.lock(ns, key[: len(cached)], -1)

    @rule(n=st.integers(0, 15))
    def evict(self, n: int) -> None:
        self.last_freed = []
        freed = self.cache.evict(n)
        assert freed == len(self.last_freed)
        expected = self.ref.evict(n) if n > 0 else []
        assert sorted(self.last_freed) == sorted(expected)

    @precondition(lambda self: not self.locks and not self.requests)
    @rule()
    def reset(self) -> None:
        self.last_freed = []
        self.cache.reset()
        assert sorted(self.last_freed) == sorted(self.ref.held)
        self.ref.entries.clear()

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        assert self.cache.evictable_size == self.ref.evictable
        assert self.cache.protected_size == self.ref.protected
        assert self.cache.total_size == len(self.ref.entries)
        held = self.ref.held
        assert len(held) == len(self.ref.entries)
        # Every slot handed out is in exactly one place.
        places = [held, self.freed_by_cache, self.freed_by_caller]
        assert sum(map(len, places)) == self.next_slot
        assert set().union(*places) == set(range(self.next_slot))


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
