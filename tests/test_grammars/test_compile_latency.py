"""Compile latency through the real Engine (stories260K, real backends): while specs compile
for as long as a pathological schema can take, plain requests and requests whose spec is cached
go on decoding, and a cached spec is served without queueing behind the compiles.

The slow compiles are the real xgrammar and llguidance backends held at a gate: a third-party
compile that takes seconds, at a moment the test picks.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest

from weft.grammars.llguidance_backend import LLGuidanceBackend
from weft.grammars.manager import COMPILE_WORKERS
from weft.grammars.spec import GrammarSpec
from weft.grammars.xgrammar_backend import XGrammarBackend

from conftest import make_engine

DEADLINE_S = 60.0
CACHED = "[a-z]+( [a-z]+){2}"
SLOW = [f"slow{i} [a-z]+" for i in range(COMPILE_WORKERS)]  # more than the chain workers
PROMPT = "Once upon a time"


class Gate:
    """Holds the compiles of the specs in `held` until `release`; counts those it holds."""

    def __init__(self, held: list[str]) -> None:
        self.held = set(held)
        self.opened = threading.Event()
        self.holding = threading.Semaphore(0)

    def wait(self, spec: GrammarSpec) -> None:
        if spec.text in self.held:
            self.holding.release()
            assert self.opened.wait(DEADLINE_S), f"{spec.text} was never released"


def _held(base: type, gate: Gate) -> type:
    class Held(base):  # type: ignore[misc, valid-type]
        def compile(self, spec: GrammarSpec) -> Any:
            gate.wait(spec)
            return super().compile(spec)

    return Held


@pytest.fixture(scope="module")
def engine(stories_dir):
    return make_engine(stories_dir, max_total_tokens=4096, grammar_backend="xgrammar,llguidance")


def test_slow_compiles_stall_neither_plain_nor_cached_requests(engine):
    gate = Gate(SLOW)
    grammars = engine.call(lambda: engine.scheduler.grammars)
    vocab = grammars.vocab
    for name, base in (("xgrammar", XGrammarBackend), ("llguidance", LLGuidanceBackend)):
        grammars._backends[name] = _held(base, gate)(vocab, grammars.compact_json)
    params = {"temperature": 0, "max_new_tokens": 8}
    warm = engine.generate(PROMPT, {**params, "regex": CACHED})
    assert warm["meta_info"]["grammar_backend"] == "xgrammar"
    done: dict[str, Any] = {}

    def slow(regex: str) -> None:
        done[regex] = engine.generate(PROMPT, {**params, "regex": regex})

    threads = [threading.Thread(target=slow, args=(regex,), daemon=True) for regex in SLOW]
    try:
        for thread in threads:
            thread.start()
        # both backends of every chain worker's race are compiling (held)
        for _ in range(2 * len(SLOW)):
            assert gate.holding.acquire(timeout=DEADLINE_S)
        held = time.perf_counter()
        hits = engine.call(lambda: engine.scheduler.constrained.cache_hits)
        plain = engine.generate(PROMPT, params)
        cached = engine.generate(PROMPT, {**params, "regex": CACHED})
        assert done == {}  # both finished while every slow spec was still compiling
        assert engine.call(lambda: engine.scheduler.constrained.cache_hits) == hits + 1
    finally:
        released = time.perf_counter()
        gate.opened.set()
        for thread in threads:
            thread.join(DEADLINE_S)
    assert plain["meta_info"]["completion_tokens"] == 8
    assert cached["meta_info"]["grammar_backend"] == "xgrammar"
    assert re.fullmatch(CACHED, cached["text"]), cached["text"]
    assert cached["text"] == warm["text"]  # greedy: the same grammar, the same output
    assert (warm["meta_info"]["grammar_cached"], cached["meta_info"]["grammar_cached"]) == (
        False,
        True,
    )
    for regex in SLOW:  # released together: whichever backend ends first serves
        assert done[regex]["meta_info"]["grammar_backend"] in ("xgrammar", "llguidance")
        assert re.fullmatch(regex, done[regex]["text"]), done[regex]["text"]
        meta = done[regex]["meta_info"]  # they waited at least while held
        assert not meta["grammar_cached"] and meta["grammar_wait_s"] >= released - held
