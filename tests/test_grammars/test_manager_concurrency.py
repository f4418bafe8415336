"""GrammarManager's threads: the compile cache under concurrency, the bound on compiles running
at once, and the compile timeout. A scripted backend stands in for the real ones, so each test
decides when a compile starts, ends or refuses.

NOTE: a regression here tends to hang rather than fail: every wait has a deadline, and a test
that would block runs its body on a daemon thread joined with a timeout.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from weft.grammars import manager as manager_module
from weft.grammars.base import GrammarBackend, GrammarUnsupported, Matcher
from weft.grammars.manager import (
    BACKLOG_BUDGET_S,
    COMPILE_WORKERS,
    RACE_BUDGET_S,
    SPARE_COMPILE_THREADS,
    GrammarError,
    GrammarManager,
)
from weft.grammars.no_grammar import AnyTextMatcher
from weft.grammars.spec import GrammarSpec
from weft.grammars.vocab import TokenVocab

from conftest import within

DEADLINE_S = 10.0  # far past anything a passing test waits for
TINY_VOCAB = TokenVocab([b"a", b"b", None], [2], "byte_level")


class ScriptedBackend(GrammarBackend):
    """Compiles a regex spec to its text in `hold_s` seconds. A spec listed in `gates` runs
    until its event is set; one in `unsupported` is refused. Records which compiles started,
    and the most running at once."""

    name = "none"

    def __init__(
        self, gates: dict[str, threading.Event] | None = None, hold_s: float = 0.0
    ) -> None:
        super().__init__(TINY_VOCAB)
        self.gates = gates or {}
        self.hold_s = hold_s
        self.unsupported: set[str] = set()
        self.started: list[str] = []
        self.running = 0
        self.most_running = 0
        self._cond = threading.Condition()

    def compile(self, spec: GrammarSpec) -> Any:
        with self._cond:
            self.started.append(spec.text)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self._cond.notify_all()
        try:
            gate = self.gates.get(spec.text)
            if gate is not None:
                assert gate.wait(DEADLINE_S), f"{spec.text} was never released"
            time.sleep(self.hold_s)
            if spec.text in self.unsupported:
                raise GrammarUnsupported(f"{spec.text} is not supported")
            return f"compiled {spec.text}"
        finally:
            with self._cond:
                self.running -= 1

    def matcher(self, compiled: Any) -> Matcher:
        return AnyTextMatcher()

    def wait_started(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= count, DEADLINE_S), (
                f"{len(self.started)} compiles started, expected {count}: {self.started}"
            )


class InlinePool:
    """Runs each job on the submitting thread: the future is done before `submit` returns, as
    when a compile finishes before its submitter gets to add a done-callback."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        pass


class JoinRecorder(dict):
    """GrammarManager._inflight that notes when a chain finds a compile in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, default)
        if found is not None:
            self.event.set()
        return found


def _manager(backend: ScriptedBackend, timeout_s: float = 30.0) -> GrammarManager:
    manager = GrammarManager(lambda: TINY_VOCAB, order=["none"], timeout_s=timeout_s)
    manager._backends["none"] = backend
    return manager


def _spec(name: str) -> GrammarSpec:
    return GrammarSpec("regex", name)


def test_a_compile_finished_before_its_callback_is_added_does_not_deadlock():
    # the compile is done when _compile_cached adds its done-callback, which then runs at once
    # on the same thread: it must not take a lock that thread already holds
    backend = ScriptedBackend()
    manager = _manager(backend)
    manager._compiles = {"none": InlinePool()}
    try:
        first = within(DEADLINE_S, lambda: manager.compile(_spec("a+")))
        second = within(DEADLINE_S, lambda: manager.compile(_spec("a+")))
    finally:
        manager.shutdown()
    assert (first.grammar, second.grammar) == ("compiled a+", "compiled a+")
    assert backend.started == ["a+"]  # the second came from the cache


@pytest.mark.parametrize("inline", [False, True], ids=["pool", "inline"])
def test_a_refusal_is_cached_like_a_grammar(inline):
    backend = ScriptedBackend()
    backend.unsupported.add("b+")
    manager = _manager(backend)
    if inline:
        manager._compiles = {"none": InlinePool()}
    try:
        for _ in range(2):
            with pytest.raises(GrammarError, match=r"^cannot compile the regex: none: b\+ is not"):
                within(DEADLINE_S, lambda: manager.compile(_spec("b+")))
    finally:
        manager.shutdown()
    assert backend.started == ["b+"]


def test_identical_specs_in_flight_compile_once():
    gate = threading.Event()
    backend = ScriptedBackend({"a+": gate})
    manager = _manager(backend)
    try:
        manager._inflight = joined = JoinRecorder()
        futures = [manager.submit(_spec("a+")) for _ in range(2)]
        backend.wait_started(1)
        assert joined.event.wait(DEADLINE_S)  # the second chain found the compile in flight
        gate.set()
        grammars = [f.result(DEADLINE_S).grammar for f in futures]
    finally:
        manager.shutdown()
    assert grammars == ["compiled a+", "compiled a+"]
    assert backend.started == ["a+"]
    assert manager._inflight == {}


def test_at_most_compile_workers_specs_compile_at_once():
    names = [f"s{i}" for i in range(COMPILE_WORKERS + 3)]
    gates = {name: threading.Event() for name in names}
    backend = ScriptedBackend(gates)
    manager = _manager(backend)
    try:
        futures = [manager.submit(_spec(name)) for name in names]
        backend.wait_started(COMPILE_WORKERS)
        time.sleep(0.2)  # time for a compile past the bound to start, were it to
        assert backend.started == names[:COMPILE_WORKERS]
        for done, name in enumerate(names):  # each end lets the next spec in line start
            gates[name].set()
            backend.wait_started(min(COMPILE_WORKERS + done + 1, len(names)))
        grammars = [f.result(DEADLINE_S).grammar for f in futures]
    finally:
        for gate in gates.values():
            gate.set()
        manager.shutdown()
    assert grammars == [f"compiled {name}" for name in names]
    assert backend.started == names  # first come, first compiled
    assert backend.most_running == COMPILE_WORKERS


def test_the_timeout_counts_from_the_compiles_start_not_from_its_queueing():
    # each compile takes 0.4 s of a 1 s timeout; the last specs wait 1.2 s for a worker
    names = [f"s{i}" for i in range(4 * COMPILE_WORKERS)]
    backend = ScriptedBackend(hold_s=0.4)
    manager = _manager(backend, timeout_s=1.0)
    try:
        futures = [manager.submit(_spec(name)) for name in names]
        compiled = [f.result(DEADLINE_S) for f in futures]
    finally:
        manager.shutdown()
    assert [(c.grammar, c.refused) for c in compiled] == [(f"compiled {n}", []) for n in names]
    assert backend.most_running == COMPILE_WORKERS


def test_compiles_past_the_timeout_keep_no_spec_waiting_and_are_cached_when_they_end():
    stuck = [f"stuck{i}" for i in range(COMPILE_WORKERS)]
    gates = {name: threading.Event() for name in stuck}
    backend = ScriptedBackend(gates)
    manager = _manager(backend, timeout_s=0.3)
    try:
        # every chain worker gives up on a compile that goes on running on its compile thread
        for future in [manager.submit(_spec(name)) for name in stuck]:
            with pytest.raises(GrammarError, match=r": none: compile timed out after 0.3 s$"):
                future.result(DEADLINE_S)
        assert backend.running == COMPILE_WORKERS
        # a spare compile thread takes the next spec at once
        assert manager.submit(_spec("a+")).result(DEADLINE_S).grammar == "compiled a+"
        for gate in gates.values():
            gate.set()
        deadline = time.monotonic() + DEADLINE_S
        while manager._inflight:  # the late results go to the cache
            assert time.monotonic() < deadline
            time.sleep(0.01)
        late = within(DEADLINE_S, lambda: manager.compile(_spec(stuck[0])))
    finally:
        for gate in gates.values():
            gate.set()
        manager.shutdown()
    assert (late.grammar, late.refused) == (f"compiled {stuck[0]}", [])
    assert backend.started == [*stuck, "a+"]


def test_a_vocabulary_being_built_holds_up_no_cache_lookup_nor_finished_compile():
    building, release = threading.Event(), threading.Event()

    def slow_vocab() -> TokenVocab:
        building.set()
        assert release.wait(DEADLINE_S)
        return TINY_VOCAB

    backend = ScriptedBackend()
    manager = GrammarManager(slow_vocab, order=["none"])
    manager._backends["none"] = backend
    builder = threading.Thread(target=lambda: manager.vocab, daemon=True)
    builder.start()
    try:
        assert building.wait(DEADLINE_S)
        for _ in range(2):  # compiled and stored, then found in the cache
            grammar = within(DEADLINE_S, lambda: manager.compile(_spec("a+")).grammar)
            assert grammar == "compiled a+"
    finally:
        release.set()
        builder.join(DEADLINE_S)
        manager.shutdown()
    assert backend.started == ["a+"]


def test_a_spec_submitted_after_shutdown_fails_at_once():
    manager = _manager(ScriptedBackend())
    manager.shutdown()
    with pytest.raises(RuntimeError, match=r"^the weft-grammar-chain pool is shut down$"):
        manager.submit(_spec("a+")).result(DEADLINE_S)


# ---- the race between backends ------------------------------------------------------------


def _race(
    first: ScriptedBackend,
    second: ScriptedBackend,
    timeout_s: float = 30.0,
    budget_s: float = RACE_BUDGET_S,
):
    """A manager whose chain is xgrammar -> llguidance, played by two scripted backends."""
    manager = GrammarManager(
        lambda: TINY_VOCAB,
        order=["xgrammar", "llguidance"],
        timeout_s=timeout_s,
        race_budget_s=budget_s,
    )
    for name, backend in zip(manager.order, (first, second), strict=True):
        backend.name = name
        manager._backends[name] = backend
    return manager


def _settle(manager: GrammarManager) -> None:
    """Wait until no compile is in flight (the late ones have landed in the cache)."""
    deadline = time.monotonic() + DEADLINE_S
    while manager._inflight:
        assert time.monotonic() < deadline, manager._inflight
        time.sleep(0.01)


def test_a_hung_backend_loses_the_race_and_its_late_grammar_serves_later_requests():
    gate = threading.Event()
    hung, fast = ScriptedBackend({"a+": gate}), ScriptedBackend()
    manager = _race(hung, fast)
    try:
        first = manager.submit(_spec("a+")).result(DEADLINE_S)
        # the preferred backend is still compiling: the fast one's grammar serves at once
        again = manager.submit(_spec("a+"))
        assert again.done()
        hits = [again.result()]
        gate.set()
        _settle(manager)
        now_preferred = manager.submit(_spec("a+"))
        assert now_preferred.done()
        hits.append(now_preferred.result())
    finally:
        gate.set()
        manager.shutdown()
    assert (first.backend.name, first.grammar, first.cached) == ("llguidance", "compiled a+", False)
    assert RACE_BUDGET_S <= first.compile_s < RACE_BUDGET_S + 1.0
    assert len(first.refused) == 1
    assert re.fullmatch(r"xgrammar: still compiling after 0\.\d\d s", first.refused[0])
    assert [(c.backend.name, c.cached, c.refused) for c in hits] == [
        ("llguidance", True, []),
        ("xgrammar", True, []),
    ]
    assert (hung.started, fast.started) == (["a+"], ["a+"])  # each compiled the spec once


def test_a_backends_compiles_running_on_hold_up_no_other_backends():
    # every compile thread of the preferred backend is taken by compiles that lost their race
    # and run on; the next spec still gets the other backend's compile at its budget
    # (as many as every compile thread of both backends, when they shared one pool)
    stuck = [f"stuck{i}" for i in range(2 * COMPILE_WORKERS + SPARE_COMPILE_THREADS)]
    threads = COMPILE_WORKERS + SPARE_COMPILE_THREADS  # the preferred backend's own
    gates = {name: threading.Event() for name in stuck}
    slow, fast = ScriptedBackend(gates), ScriptedBackend()
    manager = _race(slow, fast, budget_s=0.05)
    try:
        for name in stuck:
            assert manager.submit(_spec(name)).result(DEADLINE_S).backend.name == "llguidance"
        slow.wait_started(threads)
        compiled = manager.submit(_spec("a+")).result(DEADLINE_S)
        assert slow.started == stuck[:threads]  # the rest, a+ too, wait for its threads
    finally:
        for gate in gates.values():
            gate.set()
        manager.shutdown()
    assert (compiled.backend.name, compiled.grammar) == ("llguidance", "compiled a+")
    assert compiled.compile_s < 1.0


def test_a_queued_compile_whose_race_is_over_is_dropped():
    # the preferred backend's threads are busy; the compiles of specs the other backend has
    # served queue behind them, and are dropped once a thread takes them: a spec only the
    # preferred backend compiles then gets a thread at once
    threads = COMPILE_WORKERS + SPARE_COMPILE_THREADS
    busy, queued = threading.Event(), threading.Event()
    stuck = {f"stuck{i}": busy for i in range(threads)}
    dead = {f"dead{i}": queued for i in range(threads)}
    slow, fast = ScriptedBackend({**stuck, **dead}), ScriptedBackend()
    fast.unsupported.add("only+")
    manager = _race(slow, fast, timeout_s=3.0, budget_s=0.05)
    try:
        for name in [*stuck, *dead]:
            assert manager.submit(_spec(name)).result(DEADLINE_S).backend.name == "llguidance"
        slow.wait_started(threads)
        busy.set()
        deadline = time.monotonic() + DEADLINE_S
        while any(key[0] == "xgrammar" for key in manager._inflight):
            assert time.monotonic() < deadline, manager._inflight
            time.sleep(0.01)
        compiled = manager.submit(_spec("only+")).result(DEADLINE_S)
    finally:
        busy.set()
        queued.set()
        manager.shutdown()
    assert (compiled.backend.name, compiled.grammar) == ("xgrammar", "compiled only+")
    assert slow.started == [*stuck, "only+"]  # the queued ones never ran
    late = [k for k in manager._cache if k[0] == "xgrammar"]
    assert sorted(late) == sorted(("xgrammar", "regex", n) for n in [*stuck, "only+"])


def test_specs_waiting_for_a_race_shorten_the_budget():
    # a slow preferred backend: alone, each race gives it the whole budget; with specs queued
    # behind, the next backend joins after BACKLOG_BUDGET_S
    names = [f"s{i}" for i in range(4 * COMPILE_WORKERS)]
    gate = threading.Event()
    slow, fast = ScriptedBackend({n: gate for n in names}), ScriptedBackend()
    budget = 2.0
    manager = _race(slow, fast, budget_s=budget)
    try:
        start = time.perf_counter()
        futures = [manager.submit(_spec(name)) for name in names]
        compiled = [f.result(DEADLINE_S) for f in futures]
        seconds = time.perf_counter() - start
    finally:
        gate.set()
        manager.shutdown()
    assert [c.backend.name for c in compiled] == ["llguidance"] * len(names)
    # the last COMPILE_WORKERS races ran with nothing queued: they waited out the budget
    assert seconds >= budget
    queued = [c.compile_s for c in compiled[:-COMPILE_WORKERS]]
    assert max(queued) < BACKLOG_BUDGET_S + 1.0, queued


def test_a_refusal_passes_the_spec_on_without_waiting_out_the_budget():
    refusing, fast = ScriptedBackend(), ScriptedBackend()
    refusing.unsupported.add("a+")
    manager = _race(refusing, fast, budget_s=DEADLINE_S * 3)
    try:
        compiled = within(DEADLINE_S, lambda: manager.submit(_spec("a+")).result())
    finally:
        manager.shutdown()
    assert (compiled.backend.name, compiled.refused) == (
        "llguidance",
        ["xgrammar: a+ is not supported"],
    )


def test_a_race_every_backend_loses_names_each_reason_in_the_chains_order():
    gate = threading.Event()
    hung, refusing = ScriptedBackend({"a+": gate}), ScriptedBackend()
    refusing.unsupported.add("a+")
    manager = _race(hung, refusing, timeout_s=0.5)
    try:
        with pytest.raises(GrammarError) as err:
            manager.submit(_spec("a+")).result(DEADLINE_S)
        gate.set()
        _settle(manager)
        late = manager.submit(_spec("a+"))  # the timed-out compile landed in the cache
        assert late.done()
    finally:
        gate.set()
        manager.shutdown()
    assert str(err.value) == (
        "cannot compile the regex: xgrammar: compile timed out after 0.5 s; "
        "llguidance: a+ is not supported"
    )
    assert (late.result().backend.name, late.result().refused) == ("xgrammar", [])


def test_a_cached_spec_does_not_queue_behind_racing_specs():
    stuck = [f"stuck{i}" for i in range(COMPILE_WORKERS)]
    gates = {name: threading.Event() for name in stuck}
    backend = ScriptedBackend(gates)
    manager = _manager(backend)
    try:
        manager.submit(_spec("a+")).result(DEADLINE_S)
        racing = [manager.submit(_spec(name)) for name in stuck]
        backend.wait_started(1 + COMPILE_WORKERS)  # every chain worker is taken
        queued = manager.submit(_spec("b+"))
        # NOTE: the fastest of a few submits: one can be preempted on a loaded machine (the
        # suite runs in parallel workers), while one queued behind the race is slow every time
        submits = []
        for _ in range(5):
            start = time.perf_counter()
            cached = manager.submit(_spec("a+"))
            submits.append(time.perf_counter() - start)
            assert cached.done() and not queued.done()
        submit_s = min(submits)
        for gate in gates.values():
            gate.set()
        assert [f.result(DEADLINE_S).grammar for f in [*racing, queued]] == [
            *[f"compiled {name}" for name in stuck],
            "compiled b+",
        ]
    finally:
        for gate in gates.values():
            gate.set()
        manager.shutdown()
    assert (cached.result().grammar, cached.result().cached) == ("compiled a+", True)
    assert submit_s < 0.001, submits  # the target for a cached spec


def test_a_backends_first_build_does_not_hand_the_race_to_the_next(monkeypatch):
    built: list[str] = []

    def scripted(name: str, build_s: float) -> Callable[[TokenVocab, bool], ScriptedBackend]:
        def build(vocab: TokenVocab, compact_json: bool) -> ScriptedBackend:
            time.sleep(build_s)  # a tokenizer conversion, seconds on a real vocabulary
            backend = ScriptedBackend()
            backend.name = name
            built.append(name)
            return backend

        return build

    classes = {
        "xgrammar": scripted("xgrammar", 3 * RACE_BUDGET_S),
        "llguidance": scripted("llguidance", 0),
    }
    monkeypatch.setattr(manager_module, "backend_classes", lambda: classes)
    manager = GrammarManager(lambda: TINY_VOCAB, order=["xgrammar", "llguidance"])
    try:
        compiled = manager.submit(_spec("a+")).result(DEADLINE_S)
    finally:
        manager.shutdown()
    assert (compiled.backend.name, compiled.refused, built) == ("xgrammar", [], ["xgrammar"])


def test_without_a_race_the_chains_order_decides():
    slow, fast = ScriptedBackend(hold_s=3 * RACE_BUDGET_S), ScriptedBackend()
    manager = _race(slow, fast, budget_s=float("inf"))
    try:
        compiled = manager.submit(_spec("a+")).result(DEADLINE_S)
    finally:
        manager.shutdown()
    assert (compiled.backend.name, compiled.refused, fast.started) == ("xgrammar", [], [])
