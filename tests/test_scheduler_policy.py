"""Admission policy: exact decisions over a fake memory manager, no model.

The fake counts slots as one number: `available` (free + evictable) is what a test sets;
`admit` takes a row and locks the cached prefix (no longer evictable), `release` gives the row
back and its KV to the cache (evictable again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from weft.radix_cache import PrefixMatch
from weft.runtime.core import Req
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.admission import (
    IN_BATCH_SHARE_MIN,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    OVERLAP_MIN_DRAFT,
    Admission,
    Decision,
)


@dataclass
class FakeCache:
    prefixes: list[list[int]] = field(default_factory=list)
    enabled: bool = True

    def match_prefix(self, key: list[int], namespace: str = "") -> PrefixMatch:
        n = max((len(p) for p in self.prefixes if key[: len(p)] == p), default=0)
        return PrefixMatch(slots=torch.arange(n), node=None)


@dataclass
class FakeMemory:
    available: int
    rows: int = 8
    cache: FakeCache = field(default_factory=FakeCache)
    log: list[tuple[str, str]] = field(default_factory=list)

    def has_row(self) -> bool:
        return self.rows > 0

    def admit(self, req: Req) -> None:
        self.rows -= 1
        req.req_pool_idx = 0
        prefix = self.cache.match_prefix(req.fill_ids[: req.prefix_match_limit()]).length
        req.prefix_len = req.kv_len = prefix
        self.available -= prefix
        self.log.append(("admit", req.rid))

    def release(self, req: Req) -> None:
        self.rows += 1
        self.available += req.kv_len
        req.req_pool_idx = None
        req.prefix_len = req.kv_len = 0
        self.log.append(("release", req.rid))


def _req(rid: str, prompt: list[int], *, out: int = 0, kv: int = 0, new: int = 10) -> Req:
    """A request with `out` output tokens and `kv` tokens of KV (running if kv > 0)."""
    req = Req(rid, prompt, SamplingParams(max_new_tokens=new), output_ids=[7] * out)
    if kv:
        req.req_pool_idx, req.kv_len, req.admitted = 0, kv, True
    return req


def _admission(memory: FakeMemory, *, chunk: int = 64, max_running: int = 8, lpm: bool = False):
    return Admission(memory, chunk_size=chunk, max_running=max_running, max_seq_len=1000, lpm=lpm)


def _rids(decision: Decision) -> list[tuple[str, int]]:
    return [(r.rid, n) for r, n in decision.work]


def test_decodes_then_prefills_continue_then_admissions_within_the_chunk_budget():
    memory = FakeMemory(available=100)
    decoding = _req("d", [1] * 5, out=1, kv=5)
    prefilling = _req("p", [2] * 10, kv=4)
    new = _req("w", [3] * 10)
    running, waiting = [decoding, prefilling], [new]
    decision = _admission(memory, chunk=8).schedule(running, waiting, in_flight=False)
    assert _rids(decision) == [("d", 1), ("p", 6), ("w", 2)]  # the chunk: 6 + 2 prompt tokens
    assert decision.retracted == []
    assert running == [decoding, prefilling, new] and waiting == []
    assert new.admitted and new.cached_tokens == 0


def test_admission_reserves_the_running_requests_future_tokens():
    # r needs 1 + ceil(0.7 * 100) = 71 more; each new one 10 + ceil(0.7 * 10) = 17: with 100
    # available (1 committed to r's decode) the first fits, the second would need 116
    def run(available: int) -> tuple[Decision, FakeMemory, list[Req]]:
        memory = FakeMemory(available=available)
        running = [_req("r", [1] * 4, out=1, kv=4, new=101)]
        waiting = [_req("w1", [2] * 10), _req("w2", [3] * 10)]
        return _admission(memory).schedule(running, waiting, in_flight=False), memory, waiting

    decision, memory, waiting = run(100)
    assert _rids(decision) == [("r", 1), ("w1", 10)]
    assert [r.rid for r in waiting] == ["w2"]
    assert memory.log == [("admit", "w1"), ("admit", "w2"), ("release", "w2")]
    assert memory.rows == 7
    decision, memory, waiting = run(116)
    assert _rids(decision) == [("r", 1), ("w1", 10), ("w2", 10)] and waiting == []


def test_max_running_requests_caps_admission():
    memory = FakeMemory(available=1000)
    running = [_req("r", [1] * 4, out=1, kv=4)]
    waiting = [_req(f"w{i}", [2 + i] * 5) for i in range(3)]
    decision = _admission(memory, max_running=2).schedule(running, waiting, in_flight=False)
    assert _rids(decision) == [("r", 1), ("w0", 5)]
    assert [r.rid for r in waiting] == ["w1", "w2"]


def test_decode_short_of_kv_retracts_the_least_progressed_request():
    memory = FakeMemory(available=2)
    a = _req("a", [1] * 4, out=3, kv=6)
    b = _req("b", [2] * 4, out=1, kv=4)
    c = _req("c", [3] * 6, out=1, kv=6)  # as little output as b, a longer prompt: goes first
    queued = _req("q", [4] * 3)
    running, waiting = [a, b, c], [queued]
    admission = _admission(memory, max_running=2)
    admission.new_token_ratio = 0.2
    assert admission.decode_short(running)
    decision = admission.schedule(running, waiting, in_flight=False)
    assert _rids(decision) == [("a", 1), ("b", 1)]
    assert decision.retracted == [c]
    assert running == [a, b] and waiting == [c, queued]  # a resume goes first
    assert (c.retractions, c.req_pool_idx, c.kv_len) == (1, None, 0)
    assert memory.log == [("release", "c")] and memory.available == 8
    assert admission.new_token_ratio == INIT_NEW_TOKEN_RATIO
    assert not admission.decode_short(running)


def test_stuck_prefills_wait_for_a_step_in_flight_then_free_the_least_advanced():
    def state() -> tuple[FakeMemory, list[Req], list[Req]]:
        running = [_req("p1", [1] * 10, kv=3), _req("p2", [2] * 10, kv=5)]
        return FakeMemory(available=0), running, []

    memory, running, waiting = state()
    decision = _admission(memory).schedule(running, waiting, in_flight=True)
    assert decision == Decision([], []) and memory.log == []
    memory, running, waiting = state()
    decision = _admission(memory).schedule(running, waiting, in_flight=False)
    # p1's 3 slots back: p2 continues with them, p1 cannot be admitted again yet
    assert _rids(decision) == [("p2", 3)]
    assert [r.rid for r in decision.retracted] == ["p1"] and waiting == decision.retracted
    assert memory.log == [("release", "p1"), ("admit", "p1"), ("release", "p1")]


@pytest.mark.parametrize("lpm", [True, False])
def test_longest_cached_prefix_first_or_arrival_order(lpm):
    cache = FakeCache(prefixes=[[1, 2, 3, 4, 5, 6], [1, 2, 3]])
    memory = FakeMemory(available=1000, cache=cache)
    waiting = [_req("a", [5, 5, 5]), _req("c", [1, 2, 3, 9, 9]), _req("b", list(range(1, 9)))]
    decision = _admission(memory, lpm=lpm).schedule([], waiting, in_flight=False)
    if lpm:
        assert _rids(decision) == [("b", 2), ("c", 2), ("a", 3)]
    else:
        assert _rids(decision) == [("a", 3), ("c", 2), ("b", 2)]
    assert {r.rid: r.cached_tokens for r, _ in decision.work} == {"a": 0, "b": 6, "c": 3}
    assert memory.available == 1000 - 9  # the cached prefixes are locked


def test_a_request_sharing_an_uncached_prefix_or_blocked_waits_a_step():
    shared = list(range(100, 100 + IN_BATCH_SHARE_MIN + 8))
    prompt_prefill = _req("shared-prompt", [9] * 4)  # n > 1: children wait for its prefill
    x, y = _req("x", [*shared, 1]), _req("y", [*shared, 2])
    child = _req("child", [9] * 5)
    child.blocked_by = prompt_prefill
    z = _req("z", [7] * 5)
    waiting = [x, y, child, z]
    decision = _admission(FakeMemory(available=1000)).schedule([], waiting, in_flight=False)
    assert _rids(decision) == [("x", len(shared) + 1), ("z", 5)]
    assert waiting == [y, child]


def test_drafts_ride_behind_a_decode_where_kv_allows():
    def decode(rid: str, draft: list[int], *, pending: bool = False) -> Req:
        req = _req(rid, [1] * 4, out=1, kv=4)
        req.draft = draft
        if pending:  # its token is still on the device: counts in seq_len
            req.pending, req.kv_len = (0, 0), 5
        return req

    memory = FakeMemory(available=6)  # 3 decodes, 3 spare: one draft of 3 fits
    running = [decode("a", [5, 6, 7]), decode("b", [8, 9]), decode("c", [])]
    decision = _admission(memory).schedule(running, [], in_flight=False)
    assert _rids(decision) == [("a", 4), ("b", 1), ("c", 1)]
    long_draft = [5] * OVERLAP_MIN_DRAFT
    running = [decode("p", long_draft, pending=True), decode("q", [5], pending=True)]
    decision = _admission(FakeMemory(available=100)).schedule(running, [], in_flight=True)
    # p reads its token back before its draft can follow it; q's token goes from the device
    assert _rids(decision) == [("q", 1)]
    # within a CUDA graph's rows (draft_rows): 3 decodes of 7 rows leave 4 for drafts
    running = [decode("a", [5, 6, 7]), decode("b", [8, 9]), decode("c", [4])]
    admission = _admission(FakeMemory(available=100))
    admission.draft_rows = 7
    decision = admission.schedule(running, [], in_flight=False)
    assert _rids(decision) == [("a", 4), ("b", 1), ("c", 2)]
    admission.draft_rows = 2  # more decodes than a graph holds: eager anyway, no cap
    decision = admission.schedule(running, [], in_flight=False)
    assert _rids(decision) == [("a", 4), ("b", 3), ("c", 2)]


def test_the_reserved_share_decays_to_its_floor():
    admission = _admission(FakeMemory(available=0))
    admission.decay()
    assert admission.new_token_ratio == pytest.approx(INIT_NEW_TOKEN_RATIO - 0.001)
    for _ in range(1000):
        admission.decay()
    assert admission.new_token_ratio == MIN_NEW_TOKEN_RATIO
