"""Which requests run next step, and how many tokens each: decodes first (with a jump-forward
draft behind where KV allows), then prefills in progress within the chunk budget, then waiting
requests by the memory budget (free + evictable - what the running ones still need: prompt rest
+ a share `new_token_ratio` of their remaining max_new_tokens). Short of KV for decode, the
request with the least progress is retracted: its KV goes to the prefix cache and it waits at
the head of the queue. Policy only, over the lists it is given and a memory manager's
`Memory` view (the batch's slots are allocated later, by `build_batch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from weft.radix_cache import PrefixCache
from weft.runtime.core import Req

# Share of a running request's remaining max_new_tokens reserved when admitting new requests;
# decays while decoding goes well, jumps back after a retraction (as in SGLang).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
SMALL_CHUNK = 2048  # default prompt tokens per step (CPUs, small GPUs)
LARGE_CHUNK = 8192  # ... on GPUs of at least LARGE_CHUNK_MIN_BYTES
LARGE_CHUNK_MIN_BYTES = 35 * 2**30
LPM_MAX_QUEUE = 128  # past this, prefix matching the whole queue costs more than it saves
IN_BATCH_SHARE_MIN = 32  # defer a request sharing this many uncached tokens with one admitted
# Under the overlap schedule a request whose token is still on the device cannot feed a draft
# behind it; it sits out one step for the read-back if its draft is at least this long (a
# shorter one saves no step: the model's own next tokens check it as fast).
OVERLAP_MIN_DRAFT = 3


class Memory(Protocol):
    """What admission asks of `MemoryManager`."""

    cache: PrefixCache

    @property
    def available(self) -> int: ...  # slots that can be had now: free plus evictable
    def has_row(self) -> bool: ...
    def admit(self, req: Req) -> None: ...  # a row and the cached prefix (prefix_len, kv_len)
    def release(self, req: Req) -> None: ...  # KV to the cache, the row back


@dataclass
class Decision:
    """A step's work, [(request, tokens to process)], with KV for all of it; and the requests
    retracted to make room (now at the head of the waiting queue)."""

    work: list[tuple[Req, int]]
    retracted: list[Req]


class Admission:
    def __init__(
        self, memory: Memory, *, chunk_size: int, max_running: int, max_seq_len: int, lpm: bool
    ) -> None:
        self.memory = memory
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.max_seq_len = max_seq_len
        self.lpm = lpm  # longest cached prefix first, else first come first served
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # most rows of a decode step that feeds drafts (None: KV is the only bound): the rows a
        # CUDA graph replays, past which the step would run eagerly; a draft that does not fit
        # waits (its request decodes one token; the grammar or drafter drafts again after it)
        self.draft_rows: int | None = None

    def decode_short(self, running: list[Req]) -> bool:
        """Whether the decoding requests need more KV than there is (`schedule` retracts)."""
        return _decoding(running) > self.memory.available

    def schedule(self, running: list[Req], waiting: list[Req], *, in_flight: bool) -> Decision:
        """The next step's work. in_flight: a step's tokens are still on the device; with no
        other work they come first (they may end requests), so nothing is retracted for it.
        NOTE: a retracted request must have its tokens on the host: read a step in flight back
        first where `decode_short`."""
        retracted = self._make_room_for_decode(running, waiting)
        budget = self.chunk_size
        work: list[tuple[Req, int]] = []
        committed = 0
        spare = self.memory.available - _decoding(running)  # KV for drafts, past one per decode
        decoding = []
        for req in running:
            remaining = req.seq_len - req.kv_len
            if remaining != 1 or self._ends_with_pending(req):
                continue
            if req.pending is not None and _draft_len(req) >= OVERLAP_MIN_DRAFT:
                continue  # its draft follows the token on the device: read that back first
            decoding.append(req)
        if self.draft_rows is not None and len(decoding) <= self.draft_rows:
            # (rows past the decode tokens' own; more decodes than that run eagerly anyway)
            spare = min(spare, self.draft_rows - len(decoding))
        for req in decoding:
            n = 1
            if req.pending is None and 0 < len(req.draft) <= spare:
                n += len(req.draft)  # build_batch feeds the draft behind the token
                spare -= len(req.draft)
            work.append((req, n))
            committed += n
        for req in running:  # partially prefilled requests continue first
            remaining = req.seq_len - req.kv_len
            if remaining > 1 and budget > 0:
                n = min(remaining, budget, self.memory.available - committed)
                if n <= 0:
                    break
                work.append((req, n))
                budget -= n
                committed += n
        work += self._admit(running, waiting, budget, committed)
        if not work and not in_flight and len(running) > 1:
            # NOTE: prefills that hold all memory and cannot progress: free the least advanced.
            retracted.append(self._retract(min(running, key=lambda r: r.kv_len), running, waiting))
            then = self.schedule(running, waiting, in_flight=False)
            return Decision(then.work, retracted + then.retracted)
        return Decision(work, retracted)

    def decay(self) -> None:
        """A step ran: reserve a little less for the running requests' future tokens."""
        self.new_token_ratio = max(
            self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO
        )

    def _ends_with_pending(self, req: Req) -> bool:
        """Whether the pending token is known to be the request's last (no step for it)."""
        return req.pending is not None and (
            req.remaining_new_tokens == 0 or req.seq_len >= self.max_seq_len
        )

    def _make_room_for_decode(self, running: list[Req], waiting: list[Req]) -> list[Req]:
        need = _decoding(running)
        retracted = []
        while need > self.memory.available and len(running) > 1:
            victim = min(running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            need -= 1 if victim.seq_len - victim.kv_len == 1 else 0
            retracted.append(self._retract(victim, running, waiting))
        return retracted

    def _retract(self, req: Req, running: list[Req], waiting: list[Req]) -> Req:
        running.remove(req)
        self.memory.release(req)  # computed KV goes to the cache: a resume recomputes less
        req.retractions += 1
        waiting.insert(0, req)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        return req

    def _reserved(self, running: list[Req]) -> int:
        """KV the running requests will still need (prompt rest + a share of new tokens)."""
        return sum(
            r.seq_len - r.kv_len + math.ceil(self._future_tokens(r) * self.new_token_ratio)
            for r in running
        )

    def _future_tokens(self, req: Req) -> int:
        """New tokens the request may still produce (max_new_tokens capped by the context)."""
        return min(req.remaining_new_tokens, self.max_seq_len - req.seq_len)

    def _admit(
        self, running: list[Req], waiting: list[Req], budget: int, committed: int
    ) -> list[tuple[Req, int]]:
        work: list[tuple[Req, int]] = []
        full = len(running) >= self.max_running or not self.memory.has_row()
        if not waiting or budget <= 0 or full:
            return work  # NOTE: nothing can be admitted: skip ordering (it walks the cache)
        self._order(waiting)
        sharing = _StepPrefixes(self.memory.cache.enabled)
        for req in list(waiting):
            if budget <= 0 or len(running) >= self.max_running:
                break
            if req.blocked_by is not None and not req.blocked_by.finished:
                continue
            if not self.memory.has_row():
                break
            if sharing.shares(req):
                continue  # wait one step: it will match the prefix being computed now
            self.memory.admit(req)
            remaining = req.seq_len - req.kv_len
            n = min(remaining, budget)
            need = remaining + math.ceil(self._future_tokens(req) * self.new_token_ratio)
            free = self.memory.available - committed
            if n > free or (running and need > free - self._reserved(running)):
                self.memory.release(req)
                break
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = req.prefix_len
            waiting.remove(req)
            running.append(req)
            sharing.add(req)
            work.append((req, n))
            budget -= n
            committed += n
        return work

    def _order(self, waiting: list[Req]) -> None:
        """Longest cached prefix first (lpm) while the queue is short enough to match."""
        cache = self.memory.cache
        if not self.lpm or not cache.enabled or not 1 < len(waiting) <= LPM_MAX_QUEUE:
            return

        def cached(req: Req) -> int:
            return cache.match_prefix(
                req.fill_ids[: req.prefix_match_limit()], req.namespace
            ).length

        waiting.sort(key=lambda r: -cached(r))


def default_chunk_size(device: torch.device) -> int:
    """Prompt tokens per step when --chunked-prefill-size is unset: 8192 on a GPU of >= 35 GiB.

    Measured on an H100 (RESULTS.md, 4096-in / 2048-out workload): 8192 against 2048 gives the
    same offline throughput (+0.5 %) and a median TTFT of 65 ms instead of 78 at 1 request/s,
    since most prompts then take one step instead of two; the price is a longer stall of the
    running decodes when a full chunk lands (ITL p99 24 ms instead of 20).
    """
    if device.type == "cuda":
        return chunk_size_for_memory(torch.cuda.get_device_properties(device).total_memory)
    return SMALL_CHUNK


def chunk_size_for_memory(total_bytes: int) -> int:
    return LARGE_CHUNK if total_bytes >= LARGE_CHUNK_MIN_BYTES else SMALL_CHUNK


def _draft_len(req: Req) -> int:
    """The request's draft, or the draft model's once its token is read back (deferred)."""
    return len(req.draft) + (req.spec.deferred if req.spec is not None else 0)


def _decoding(running: list[Req]) -> int:
    """Running requests that decode a token next step (one new KV slot each)."""
    return sum(1 for r in running if r.seq_len - r.kv_len == 1)


class _StepPrefixes:
    """The uncached prefixes that the requests admitted in a step compute. A request that shares
    IN_BATCH_SHARE_MIN tokens past one's cached prefix waits a step, then matches the cache.

    Request r shares with an admitted o iff their first o.prefix_len + IN_BATCH_SHARE_MIN + 1
    tokens agree; those prefixes are kept in sets by length, so a check costs one lookup per
    distinct length, O(prefix) each (comparing r with every admitted request cost O(n^2) per
    step: ~0.4 s for 120 programs of a 1,000-token few-shot prefix). Admitted requests with many
    different cached-prefix lengths make it O(n * lengths) again, still without numpy copies.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._by_len: dict[int, set[tuple[str, tuple[int, ...]]]] = {}

    def add(self, req: Req) -> None:
        n = req.prefix_len + IN_BATCH_SHARE_MIN + 1
        if self.enabled and len(req.fill_ids) >= n:
            self._by_len.setdefault(n, set()).add((req.namespace, tuple(req.fill_ids[:n])))

    def shares(self, req: Req) -> bool:
        if not self._by_len:
            return False
        ids = req.fill_ids[: req.prefix_match_limit()]
        return any(
            len(ids) >= n and (req.namespace, tuple(ids[:n])) in keys
            for n, keys in self._by_len.items()
        )
