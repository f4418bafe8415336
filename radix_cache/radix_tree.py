"""RadixCache: a radix tree over token ids whose nodes hold the KV slots of their edge.

Each namespace has its own root (an empty edge). A node's edge is a non-empty run of token ids
(`key`, int64 numpy array) with the slots of those tokens (`slots`, int64 CPU tensor, same
length); children are keyed by the first token of their edge. Page size is one token.

Counters kept exact at every step (audited by `check_invariants`):

| name                 | meaning                                                            |
|----------------------|--------------------------------------------------------------------|
| `node.own_locks`     | `lock(node)` calls not yet undone on this very handle              |
| `node.lock_ref`      | `own_locks` + sum of the children's `lock_ref` (locks in subtree)  |
| `node.last_access`   | tick of the last match/insert whose path went through the node;    |
|                      | one tick per call, so a parent's is >= each child's                |
| `_evictable`         | tokens in non-root nodes with `lock_ref == 0`                      |
| `_protected`         | tokens in non-root nodes with `lock_ref > 0`                       |
| `_leaves`            | non-root nodes without children (the eviction candidates)          |
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .base import FreeFn, PrefixCache, PrefixMatch

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
_EMPTY_KEY = np.empty(0, dtype=np.int64)


class _Node:
    __slots__ = (
        "alive",
        "children",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "own_locks",
        "parent",
        "slots",
        "uid",
    )

    def __init__(
        self,
        key: np.ndarray,
        slots: torch.Tensor,
        parent: _Node | None,
        uid: int,
        last_access: int,
        namespace: str | None = None,
    ) -> None:
        self.key = key  # int64 [n]; owned (never a view of a caller's array)
        self.slots = slots  # int64 [n] CPU; owned (never a view of a caller's tensor)
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.uid = uid  # creation order; breaks LRU ties deterministically
        self.last_access = last_access
        self.lock_ref = 0
        self.own_locks = 0
        self.namespace = namespace  # set on roots only
        self.alive = True  # False once evicted or dropped by reset

    @property
    def is_root(self) -> bool:
        return self.namespace is not None

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        kind = (
            f"root {self.namespace!r}"
            if self.is_root
            else f"{_preview(self.key)} ({len(self)} tok)"
        )
        return f"<node {kind} lock_ref={self.lock_ref} t={self.last_access}>"


class RadixCache(PrefixCache):
    """Prefix cache over a radix tree, with per-namespace roots and global LRU eviction."""

    enabled = True

    def __init__(self, free_fn: FreeFn) -> None:
        super().__init__(free_fn)
        self._roots: dict[str, _Node] = {}
        self._leaves: set[_Node] = set()
        self._clock = 0  # monotonic LRU clock (not wall time: deterministic tests)
        self._next_uid = 0
        self._evictable = 0
        self._protected = 0

    # ---- queries --------------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int] | torch.Tensor, namespace: str = "") -> PrefixMatch:
        tokens = _as_tokens(key)
        root = self._roots.get(namespace)
        if root is None:
            # NOTE: an unregistered root, so that lookups in unknown namespaces (one per cache
            # salt) leave nothing behind; locking it is harmless since it holds no tokens.
            empty_root = self._new_node(_EMPTY_KEY, _EMPTY_SLOTS, None, namespace)
            return PrefixMatch(_EMPTY_SLOTS.clone(), empty_root)
        now = self._tick()
        node, pos = root, 0
        parts: list[torch.Tensor] = []
        root.last_access = now
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = _common_prefix_len(child.key, tokens[pos:])
            if n < len(child):
                # The match ends inside this edge: split so the returned node covers exactly it.
                # The next lookup then finds no child and the loop ends.
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node, pos = child, pos + n
        # torch.cat copies: the caller never gets a view of the cache's own tensors.
        slots = torch.cat(parts) if parts else _EMPTY_SLOTS.clone()
        return PrefixMatch(slots, node)

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    # ---- updates --------------------------------------------------------------------------

    def insert(
        self, key: Sequence[int] | torch.Tensor, slots: torch.Tensor, namespace: str = ""
    ) -> int:
        tokens = _as_tokens(key)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ValueError("slots must be a 1-D tensor")
        if len(tokens) != slots.numel():
            raise ValueError(f"len(key)={len(tokens)} != len(slots)={slots.numel()}")
        if len(tokens) == 0:
            return 0
        # NOTE: a CUDA `slots` makes this a host-device sync; the scheduler passes CPU slots.
        slots = slots.to(device="cpu", dtype=torch.int64)
        root = self._roots.get(namespace)
        now = self._tick()
        if root is None:
            root = self._new_node(_EMPTY_KEY, _EMPTY_SLOTS, None, namespace)
            self._roots[namespace] = root
        node, pos = root, 0
        root.last_access = now
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                self._add_leaf(node, tokens[pos:], slots[pos:], now)
                return pos
            n = _common_prefix_len(child.key, tokens[pos:])
            if n < len(child):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def lock(self, node: object) -> None:
        start = self._handle(node)
        if not start.alive:
            raise RuntimeError(f"lock on an evicted node {start!r}: lock right after match_prefix")
        start.own_locks += 1
        cur: _Node | None = start
        while cur is not None:
            if cur.lock_ref == 0:
                self._evictable -= len(cur)
                self._protected += len(cur)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: object) -> None:
        start = self._handle(node)
        # NOTE: checked on the handle's own count, not `lock_ref`: a lock held through a
        # descendant must not be released by unlocking its ancestor.
        if start.own_locks <= 0:
            raise RuntimeError(f"unlock without a matching lock on {start!r}")
        start.own_locks -= 1
        cur: _Node | None = start
        while cur is not None:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._protected -= len(cur)
                self._evictable += len(cur)
            cur = cur.parent

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        # Rebuilt per call: O(leaves log leaves), fine for thousands of leaves, and no stale
        # entries to reason about. The uid makes ties deterministic and keeps nodes uncompared.
        heap = [(n.last_access, n.uid, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed_parts: list[torch.Tensor] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed_parts.append(node.slots)
            freed += len(node)
            parent = self._remove_leaf(node)
            if parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        if freed_parts:
            self.free_fn(torch.cat(freed_parts))  # one call per evict
        return freed

    def reset(self) -> None:
        locked = [ns for ns, root in self._roots.items() if root.lock_ref > 0]
        if self._protected or locked:
            raise AssertionError(
                f"reset while locked: protected={self._protected} tokens, namespaces {locked}"
            )
        parts = []
        for node in self._walk():
            node.alive = False
            if not node.is_root:
                parts.append(node.slots)
        self._roots.clear()
        self._leaves.clear()
        self._evictable = 0
        if parts:
            self.free_fn(torch.cat(parts))

    # ---- audit and debugging --------------------------------------------------------------

    def check_invariants(self) -> None:
        evictable = protected = 0
        leaves: set[_Node] = set()
        slot_parts: list[torch.Tensor] = []
        for ns, root in self._roots.items():
            _check(root.is_root and root.namespace == ns, f"root of {ns!r} is {root!r}")
            _check(root.parent is None and len(root) == 0, f"root of {ns!r} has a parent or key")
            _check(len(root.slots) == 0, f"root of {ns!r} holds slots")
            _check(bool(root.children), f"empty root of {ns!r} left behind")
        for node in self._walk():
            _check(node.alive, f"dead node {node!r} in the tree")
            _check(node.own_locks >= 0, f"{node!r} has own_locks={node.own_locks}")
            _check(node.last_access <= self._clock, f"{node!r} is from the future")
            child_locks = 0
            for tok, child in node.children.items():
                _check(child.parent is node, f"{child!r} does not point back to {node!r}")
                _check(not child.is_root, f"root {child!r} below {node!r}")
                _check(int(child.key[0]) == tok, f"{child!r} filed under token {tok}")
                _check(
                    child.last_access <= node.last_access,
                    f"{child!r} accessed after its parent {node!r}",
                )
                child_locks += child.lock_ref
            _check(
                node.lock_ref == node.own_locks + child_locks,
                f"{node!r}: lock_ref != own_locks {node.own_locks} + children's {child_locks}",
            )
            if node.is_root:
                continue
            _check(len(node) > 0, f"empty edge at {node!r}")
            _check(node.key.dtype == np.int64 and node.key.ndim == 1, f"bad key array {node!r}")
            s = node.slots
            _check(
                s.dtype == torch.int64 and s.dim() == 1 and s.device.type == "cpu",
                f"bad slots tensor at {node!r}: {s.dtype} {tuple(s.shape)} {s.device}",
            )
            _check(s.numel() == len(node), f"{node!r} has {s.numel()} slots")
            if node.lock_ref > 0:
                protected += len(node)
            else:
                evictable += len(node)
            if not node.children:
                leaves.add(node)
            slot_parts.append(s)
        _check(
            evictable == self._evictable,
            f"evictable counter {self._evictable} != {evictable} in the tree",
        )
        _check(
            protected == self._protected,
            f"protected counter {self._protected} != {protected} in the tree",
        )
        _check(leaves == self._leaves, "leaf set out of sync with the tree")
        if slot_parts:
            all_slots = torch.cat(slot_parts)
            dup = all_slots.numel() - torch.unique(all_slots).numel()
            _check(dup == 0, f"{dup} slot(s) held twice")

    def pretty(self) -> str:
        lines = [
            f"RadixCache total={self.total_size} evictable={self._evictable} "
            f"protected={self._protected} leaves={len(self._leaves)} clock={self._clock}"
        ]
        for ns, root in self._roots.items():
            lines.append(f"namespace {ns!r} lock_ref={root.lock_ref} t={root.last_access}")
            stack = [(child, 1) for child in reversed(root.children.values())]
            while stack:
                node, depth = stack.pop()
                lines.append(
                    f"{'  ' * depth}{_preview(node.key)} ({len(node)} tok) "
                    f"slots={_preview(node.slots.numpy())} lock_ref={node.lock_ref} "
                    f"own={node.own_locks} t={node.last_access}"
                )
                stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)

    # ---- helpers --------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(
        self,
        key: np.ndarray,
        slots: torch.Tensor,
        parent: _Node | None,
        namespace: str | None = None,
    ) -> _Node:
        self._next_uid += 1
        return _Node(key, slots, parent, self._next_uid, self._clock, namespace)

    def _handle(self, node: object) -> _Node:
        if not isinstance(node, _Node):
            raise TypeError(f"not a RadixCache node handle: {node!r}")
        return node

    def _walk(self) -> Iterator[_Node]:
        """Every registered node, roots included. Iterative: a path can be thousands deep."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _add_leaf(self, parent: _Node, key: np.ndarray, slots: torch.Tensor, now: int) -> None:
        # Copies: a view would pin the caller's whole buffer and see the caller's later writes.
        leaf = self._new_node(key.copy(), slots.clone(), parent)
        leaf.last_access = now
        parent.children[int(key[0])] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += len(leaf)

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node`'s edge after `n` tokens; return the new upper node.

        NOTE: the existing object keeps the lower part, so handles callers hold (and their
        `own_locks`) still name the same end of the same prefix. The upper node carries the
        same `lock_ref` (every lock below passes through it) and the same access time.
        """
        assert 0 < n < len(node), (n, len(node))
        parent = node.parent
        assert parent is not None
        upper = self._new_node(node.key[:n].copy(), node.slots[:n].clone(), parent)
        upper.last_access = node.last_access
        upper.lock_ref = node.lock_ref
        node.key = node.key[n:].copy()
        node.slots = node.slots[n:].clone()
        node.parent = upper
        upper.children[int(node.key[0])] = node
        parent.children[int(upper.key[0])] = upper
        return upper

    def _remove_leaf(self, node: _Node) -> _Node:
        """Unlink an unlocked leaf (its slots are the caller's to free); return its parent."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[int(node.key[0])]
        self._leaves.discard(node)
        self._evictable -= len(node)
        node.alive = False
        node.parent = None  # a caller's stale handle must not pin the rest of the tree
        if parent.is_root:
            ns = parent.namespace
            assert ns is not None
            if not parent.children and self._roots.get(ns) is parent:
                del self._roots[ns]  # no empty roots pile up, one per cache salt ever seen
        elif not parent.children:
            self._leaves.add(parent)
        return parent


def _as_tokens(key: Sequence[int] | torch.Tensor) -> np.ndarray:
    """int64 [n] view or copy of `key`; only read, copied before it is stored."""
    if isinstance(key, torch.Tensor):
        arr = key.detach().to(device="cpu", dtype=torch.int64).numpy()
    else:
        arr = np.asarray(key, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"key must be 1-D, got shape {arr.shape}")
    return arr


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int64 arrays (vectorized first mismatch)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    first = int(neq.argmax())  # 0 both when all are equal and when the first one differs
    return first if neq[first] else n


def _preview(values: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(str(int(v)) for v in values[:limit])
    return f"[{head}{', ...' if len(values) > limit else ''}]"


def _check(cond: bool, msg: str) -> None:
    # Not `assert`: the audit must keep working under `python -O`.
    if not cond:
        raise AssertionError(msg)
