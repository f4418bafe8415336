"""Compiling specs through a chain of backends, off the scheduler's loop, with a cache.

`GrammarManager.submit(spec)` returns a future at once. A spec whose grammar is cached gets a
future already done; any other races the backends in order (default xgrammar -> llguidance ->
outlines) on a chain worker: the preferred backend starts first, and the next one starts as soon
as every backend running has had the race budget (RACE_BUDGET_S unless configured, at most
BACKLOG_BUDGET_S while other specs wait for a race), or has refused the spec (at once), or has
run past the compile timeout. The first backend that compiles the spec serves the request; when
several are done at one look, the earliest in the order. The scheduler polls the future between
steps, so a request waiting for its grammar holds up nobody.

Compiled grammars (and refusals) are cached by (backend, kind, spec text) per vocabulary; the
manager itself belongs to one model's vocabulary. A compile that lost the race, or ran past its
timeout, is not stopped (native code cannot be) and lands in the cache when it ends.

Which cached grammar serves a spec: that of the earliest backend in the order whose grammar is
cached. A later backend's grammar serves while an earlier one is still compiling, so the
preferred backend takes over the spec once its compile lands. Every backend that compiles a spec
enforces it exactly (one that would weaken it refuses it), so any of them may serve.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from weft.grammars.base import GrammarBackend, GrammarUnsupported, Matcher
from weft.grammars.daemon_pool import DaemonPool
from weft.grammars.jump_forward import settled_tokens
from weft.grammars.mask_fill import MaskFill
from weft.grammars.spec import INLINE_SPEC_CHARS, GrammarSpec, parse_spec, skip_class
from weft.grammars.vocab import TokenVocab

logger = logging.getLogger(__name__)

DEFAULT_ORDER = ("xgrammar", "llguidance", "outlines")
CACHE_ENTRIES = 1024
COMPILE_WORKERS = 2  # specs racing at once (see GrammarManager.__init__)
SPARE_COMPILE_THREADS = 4  # for compiles that run on past their race or their timeout
# How long a backend compiles alone before the next in the chain joins the race. On the 40-schema
# core corpus (Qwen2 vocabulary, a 2-core CPU) xgrammar takes 0.11 s at the median but 4.6 s at
# p90 and 16 s at worst, llguidance 6 ms at worst: 0.2 s leaves the usual spec to the preferred
# backend (its masks are the cheapest per step) and still starts three backends within 0.4 s, so
# a spec some backend compiles in 0.1 s waits well under a second.
RACE_BUDGET_S = 0.2
# ... but while other specs wait for a race: 100 specs at once otherwise queued for ~10 s behind
# races that each gave a slow xgrammar its 0.2 s (2 races at a time). llguidance compiles in
# 10 ms at p99 on a 2-core CPU, so the third backend rarely starts even so.
BACKLOG_BUDGET_S = 0.02
BUILD_POLL_S = 0.05  # how often a race looks whether a backend it waits for is built
MAX_JUMP_FORWARD_BYTES = 1024  # forced text tokenized for one draft (the rest comes later)
# A spec whose minimum repetition counts multiply past this gets no jump-forward (see
# `forced_repeats`).
MAX_FORCED_REPEATS = 1024


def backend_classes() -> dict[str, Callable[[TokenVocab, bool], GrammarBackend]]:
    from weft.grammars.llguidance_backend import LLGuidanceBackend
    from weft.grammars.no_grammar import NoGrammarBackend
    from weft.grammars.outlines_backend import OutlinesBackend
    from weft.grammars.xgrammar_backend import XGrammarBackend

    return {
        "xgrammar": XGrammarBackend,
        "llguidance": LLGuidanceBackend,
        "outlines": OutlinesBackend,
        "none": NoGrammarBackend,
    }


class GrammarError(Exception):
    """No backend could compile the spec: the request fails with this message (a 400)."""


@dataclass
class Compiled:
    backend: GrammarBackend
    grammar: Any
    spec: GrammarSpec
    compile_s: float  # from the spec's submission (or its race's start) to its grammar
    refused: list[str] = field(default_factory=list)  # why earlier backends did not serve it
    jump_forward: bool = True  # False: the forced text may be too long to ask for
    cached: bool = False  # found in the cache at submission (no race ran)
    ready_at: float = field(default_factory=time.perf_counter)  # when the race or lookup ended


@dataclass
class _Attempt:
    """One backend's part in a spec's race."""

    name: str
    future: Future[Any]  # the compile's (shared with any race of the same spec on this backend)
    started: float  # perf_counter: its budget and timeout count from here (see `_since`)
    waits: bool  # among the compile's waiters (a compile found in the cache has none)


class _Dropped(Exception):
    """A queued compile that no race waited for any more when its thread took it."""


class RequestGrammar:
    """One request's matcher, plus weft's handling of end tokens (every backend sees the same
    end tokens: allowed exactly where the grammar may end; accepting one ends the grammar)."""

    def __init__(self, compiled: Compiled, end_ids: Sequence[int]) -> None:
        self.compiled = compiled
        self.matcher: Matcher = compiled.backend.matcher(compiled.grammar)
        self.end_ids = list(end_ids)
        self.ended = False
        self.jump_forward_tokens = 0  # forced tokens the model confirmed in a draft's forward

    @property
    def backend_name(self) -> str:
        return self.compiled.backend.name

    def accept(self, token: int) -> bool:
        if token in self.end_ids:
            self.ended = True
            return True
        return self.matcher.accept(token)

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    def jump_forward(self) -> bytes:
        if self.ended or not self.compiled.jump_forward:
            return b""
        return self.matcher.jump_forward()

    def draft(self, limit: int) -> list[int]:
        """At most `limit` tokens of the text the grammar forces next, settled (see
        grammars/jump_forward.py), not accepted: a draft the scheduler verifies against the
        model in one forward before any of it becomes output."""
        if limit <= 0:
            return []
        forced = _cut_at_char(self.jump_forward(), MAX_JUMP_FORWARD_BYTES)
        if not forced:
            return []
        return settled_tokens(self.compiled.backend.vocab, forced)[:limit]


class GrammarManager:
    def __init__(
        self,
        vocab_factory: Callable[[], TokenVocab],
        order: Sequence[str] = DEFAULT_ORDER,
        timeout_s: float = 30.0,
        workers: int = COMPILE_WORKERS,
        compact_json: bool = False,
        race_budget_s: float = RACE_BUDGET_S,
    ) -> None:
        """compact_json: JSON under a schema on one line (GrammarBackend). race_budget_s: how
        long a backend compiles alone before the next joins (inf: the chain's order decides
        which backend serves, with no race, as tests of the routing need on a loaded CPU)."""
        known = backend_classes()
        unknown = [name for name in order if name not in known]
        if unknown or not order:
            raise ValueError(
                f"unknown grammar backend(s) {unknown} (known: {', '.join(known)})"
                if unknown
                else "the grammar backend order is empty"
            )
        self.order = list(order)
        self.timeout_s = timeout_s
        self.race_budget_s = race_budget_s
        self.compact_json = compact_json
        self._vocab_factory = vocab_factory
        self._vocab: TokenVocab | None = None
        self._backends: dict[str, GrammarBackend | Exception] = {}
        self._built_at: dict[str, float] = {}  # perf_counter at each build's end (else 0)
        # NOTE: two locks. `_build_lock` is held while the vocabulary and the backends are
        # built (seconds, in code that is not ours); `_lock` guards the cache and the compiles
        # in flight and is held only to read and update them and to queue a compile: no future
        # is waited on, nor a callback added, under it (a compile's done-callback takes it).
        self._build_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._inflight: dict[tuple[str, str, str], Future[Any]] = {}
        # races waiting for each compile in flight; a compile none waits for when a thread
        # takes it is dropped (a burst otherwise queued a backend's compiles, each seconds,
        # behind ones whose race another backend had won). Its own lock, taken last: a
        # compile thread checks it without `_lock`, which a race may hold while submitting.
        self._waiters: dict[tuple[str, str, str], int] = {}
        self._waiters_lock = threading.Lock()
        # NOTE: compiles share the scheduler process's GIL and cores: each one running slows
        # every decoding step (measured: plain requests went from 0.05 s to p50 0.43 s, max
        # 6.9 s, while 10 large schemas compiled 4 at a time). So `workers` specs race at once
        # (2, not 1: a small spec need not wait behind one large race), and further specs wait
        # in the chain queue, where no timeout runs (a backend's timeout counts from its start
        # in the race, when the race has a compile thread for it: it times the compile, not the
        # queue). A cached spec never enters the queue (`submit`).
        # A pool for the races and one per backend for its compiles: a compile that loses its
        # race or runs past the timeout keeps its compile thread until it ends (native code
        # cannot be interrupted) while its race is over, so each backend has
        # SPARE_COMPILE_THREADS more compile threads than races can use, and its compiles that
        # run on never hold up another backend's (measured: 100 specs at once on a 2-core CPU,
        # llguidance's 2 ms compiles queued behind xgrammar's seconds-long ones in one shared
        # pool). Only with more of one backend's compiles than that running on at once does
        # its compile wait for a thread with its timeout running, and then it should time out:
        # those threads may never come back.
        self._chains = DaemonPool(workers, "weft-grammar-chain")
        self._compiles = {
            name: DaemonPool(workers + SPARE_COMPILE_THREADS, f"weft-grammar-{name}")
            for name in self.order
        }
        # a step's mask fill: the backends' batches side by side (`fill`, or started and
        # joined later by the scheduler: MaskFill.start)
        self.fills = MaskFill(len(self.order))

    @property
    def vocab(self) -> TokenVocab:
        with self._build_lock:
            if self._vocab is None:
                self._vocab = self._vocab_factory()
            return self._vocab

    def prepare(self) -> Future[None]:
        """Convert the vocabulary and build every backend of the chain now, on a daemon thread:
        seconds on a 150k vocabulary (llguidance's 2.3 s on Qwen2's), which the first
        constrained requests would otherwise wait for. A compile that comes meanwhile waits
        only for the builds it needs, as it would without this."""
        done: Future[None] = Future()

        def build() -> None:
            try:
                for name in self.order:
                    self._backend(name)
                done.set_result(None)
            except Exception as exc:  # the vocabulary: each constrained request will say why
                logger.warning("the grammar vocabulary could not be built: %s", exc)
                done.set_exception(exc)

        threading.Thread(target=build, name="weft-grammar-prepare", daemon=True).start()
        return done

    def submit(self, spec: GrammarSpec) -> Future[Compiled]:
        """The spec's compiled grammar: a future already done if it is cached (no queue, no
        thread), else one that a chain worker resolves through the race."""
        start = time.perf_counter()
        compiled = self._cached(spec, start)
        if compiled is None:
            return self._chains.submit(self.compile, spec)
        future: Future[Compiled] = Future()
        future.set_result(compiled)
        return future

    def submit_field(
        self, field: str, text: str, max_chars: int, validated: bool = False
    ) -> Future[Compiled]:
        """parse_spec (InvalidSpec comes from the future), then `submit`. A short text is parsed
        here (parse_spec caches it: microseconds on a repeat), a long one on a chain worker."""
        if len(text) <= INLINE_SPEC_CHARS:
            try:
                spec = parse_spec(field, text, max_chars, validated)
            except Exception as exc:
                failed: Future[Compiled] = Future()
                failed.set_exception(exc)
                return failed
            return self.submit(spec)
        return self._chains.submit(
            lambda: self.compile(parse_spec(field, text, max_chars, validated))
        )

    def _cached(self, spec: GrammarSpec, start: float) -> Compiled | None:
        """The spec's grammar from the cache, by the earliest backend in the order that has one
        (see the module's docstring), or None."""
        refused = []
        with self._lock:
            for name in self.order:
                key = (name, spec.kind, spec.text)
                if key not in self._cache:
                    continue  # not compiled yet (or still compiling), or evicted
                grammar = self._cache[key]
                if isinstance(grammar, GrammarUnsupported):
                    refused.append(f"{name}: {grammar}")
                    continue
                backend = self._backends.get(name)
                if not isinstance(backend, GrammarBackend):
                    continue
                self._cache.move_to_end(key)
                break
            else:
                return None
        elapsed = time.perf_counter() - start
        short = _jump_forward_ok(spec)
        return Compiled(backend, grammar, spec, elapsed, refused, jump_forward=short, cached=True)

    def compile(self, spec: GrammarSpec) -> Compiled:
        """The race through the chain (see the module's docstring), blocking (the chain workers
        run this)."""
        attempts: list[_Attempt] = []
        try:
            return self._race(spec, attempts)
        finally:
            for attempt in attempts:  # the compiles that lost go on only if already running
                if attempt.waits:
                    self._wait_for((attempt.name, spec.kind, spec.text), -1)

    def _race(self, spec: GrammarSpec, attempts: list[_Attempt]) -> Compiled:
        start = time.perf_counter()
        refused: dict[str, str] = {}
        waiting = list(self.order)  # not started yet
        running: list[_Attempt] = []  # in the chain's order
        while True:
            now = time.perf_counter()
            budget = self.race_budget_s
            if self._chains.backlog and math.isfinite(budget):  # (inf: no race at all)
                budget = min(budget, BACKLOG_BUDGET_S)
            for attempt in list(running):  # NOTE: in order: the earliest done serves
                name, future, since = attempt.name, attempt.future, self._since(attempt)
                if future.done():
                    exc = future.exception()
                    if isinstance(exc, _Dropped):  # joined just as it was dropped: again
                        if attempt.waits:
                            self._wait_for((name, spec.kind, spec.text), -1)
                        attempt.future, attempt.waits = self._compile_future(name, spec)
                        continue
                    if exc is None:
                        for other in running:
                            if other is not attempt:
                                ran = now - (self._since(other) or now)
                                refused[other.name] = f"still compiling after {ran:.2f} s"
                        backend = self._backends[name]
                        assert isinstance(backend, GrammarBackend)
                        return Compiled(
                            backend,
                            future.result(),
                            spec,
                            now - start,
                            [f"{n}: {refused[n]}" for n in self.order if n in refused],
                            jump_forward=_jump_forward_ok(spec),
                        )
                    refused[name] = _refusal(exc)
                    if not isinstance(exc, GrammarUnsupported):
                        logger.warning(
                            "grammar backend %s failed on %s: %r", name, spec.describe(), exc
                        )
                    running.remove(attempt)
                elif since is not None and now - since >= self.timeout_s:
                    refused[name] = f"compile timed out after {self.timeout_s:g} s"
                    logger.warning("grammar compile timed out on %s: %s", name, spec.describe())
                    running.remove(attempt)
            # the next backend joins once every one running has had its budget
            sinces = [self._since(a) for a in running]
            building = None in sinces
            counted = [t for t in sinces if t is not None]
            if not running:
                joins = now
            else:  # NOTE: not `now - budget + budget` with none running: inf - inf is nan
                joins = math.inf if building else max(counted) + budget
            if waiting and joins <= now:
                name = waiting.pop(0)
                built = self._backends.get(name)
                if isinstance(built, Exception):
                    refused[name] = f"unavailable ({built})"
                else:
                    future, waits = self._compile_future(name, spec)
                    attempts.append(_Attempt(name, future, now, waits))
                    running.append(attempts[-1])
                continue
            if not running:
                reasons = [f"{n}: {refused[n]}" for n in self.order]
                raise GrammarError(f"cannot compile the {spec.kind}: " + "; ".join(reasons))
            wake = min(counted, default=now) + self.timeout_s
            if waiting:
                wake = min(wake, joins)
            if building:  # NOTE: a build's end is no future's: look again shortly
                wake = min(wake, now + BUILD_POLL_S)
            concurrent.futures.wait(
                [a.future for a in running],
                timeout=max(wake - now, 0.0),
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    def _since(self, attempt: _Attempt) -> float | None:
        """When the attempt's budget and timeout began: its start, or its backend's build if
        that ended later (a first build takes seconds: llguidance's 1.8 s on Qwen2's vocabulary,
        which must not hand the race to the next backend); None while the backend builds."""
        if attempt.name not in self._backends:
            return None
        return max(attempt.started, self._built_at.get(attempt.name, 0.0))

    def _compile_future(self, name: str, spec: GrammarSpec) -> tuple[Future[Any], bool]:
        """The backend's compile of the spec: done if cached, the one in flight if any (a race
        of the same spec, or a compile running on past its race), else a new one; and whether
        the caller now counts among its waiters (not for a cached one)."""
        key = (name, spec.kind, spec.text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                result = self._cache[key]
                done: Future[Any] = Future()
                if isinstance(result, GrammarUnsupported):
                    done.set_exception(result)
                else:
                    done.set_result(result)
                return done, False
            self._wait_for(key, +1)  # NOTE: before the submit: a compile may start at once
            future = self._inflight.get(key)
            if future is not None:
                return future, True
            future = self._compiles[name].submit(self._compile_on, name, spec)
            self._inflight[key] = future
        # NOTE: outside the lock: on a future already done (a quick compile) the callback runs at
        # once on this thread, and _store takes the lock, which is not reentrant. Until _store
        # runs, a race asking for the same key gets the done future.
        future.add_done_callback(functools.partial(self._store, key))
        return future, True

    def _wait_for(self, key: tuple[str, str, str], change: int) -> None:
        with self._waiters_lock:
            count = self._waiters.get(key, 0) + change
            if count > 0:
                self._waiters[key] = count
            else:
                self._waiters.pop(key, None)

    def _compile_on(self, name: str, spec: GrammarSpec) -> Any:
        """A compile thread's job: the backend (built here the first time: seconds, which count
        in its race but hold up neither the race nor the other backends) compiles the spec,
        unless every race that wanted it has ended meanwhile."""
        with self._waiters_lock:
            if (name, spec.kind, spec.text) not in self._waiters:
                raise _Dropped(f"{name}: no race waits for it")
        backend = self._backends.get(name)  # NOTE: built: no lock (the vocabulary's may be held)
        if backend is None:
            backend = self._backend(name)
        if isinstance(backend, Exception):
            raise GrammarUnsupported(f"unavailable ({backend})")
        return backend.compile(spec)

    def _store(self, key: tuple[str, str, str], future: Future[Any]) -> None:
        """The compile's done-callback (on its compile worker, or at once on the race that
        submitted it): the result, or the refusal, goes from in flight to the cache."""
        with self._lock:
            if self._inflight.get(key) is future:  # (a dropped one may have a successor)
                del self._inflight[key]
            exc = future.exception()
            if exc is None or isinstance(exc, GrammarUnsupported):
                self._cache[key] = future.result() if exc is None else exc
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)

    def _backend(self, name: str) -> GrammarBackend | Exception:
        vocab = self.vocab  # NOTE: before taking _build_lock, which `vocab` takes too
        with self._build_lock:
            backend = self._backends.get(name)
            if backend is None:
                try:
                    backend = backend_classes()[name](vocab, self.compact_json)
                except Exception as exc:  # a missing package or a tokenizer it cannot read
                    logger.warning("grammar backend %s is unavailable: %s", name, exc)
                    backend = exc
                self._built_at[name] = time.perf_counter()  # NOTE: first (see `_since`)
                self._backends[name] = backend
            return backend

    def fill(self, grammars: list[RequestGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill the given rows of a CPU int32 bitmask, batched per backend where it can; the
        backends' batches run at once (each on its own native threads, without the GIL)."""
        self.fills.fill(grammars, bitmask, rows)

    def fill_draft(
        self, grammar: RequestGrammar, draft: list[int], bitmask: torch.Tensor, row: int
    ) -> int:
        """Rows row + 1 .. row + len(draft): the masks after each draft token (`fill` writes row
        itself, before any). Returns how many draft tokens the grammar accepts; the rows past
        them are left as they were. The grammar ends where it started."""
        accepted = 0
        try:
            for tid in draft:
                if not grammar.accept(tid):
                    break
                accepted += 1
                self.fill([grammar], bitmask, [row + accepted])
        finally:
            grammar.rollback(accepted)
        return accepted

    def shutdown(self) -> None:
        self._chains.shutdown()
        for pool in self._compiles.values():
            pool.shutdown()
        self.fills.shutdown()


def _refusal(exc: BaseException) -> str:
    """Why a backend did not compile a spec, in one line."""
    if isinstance(exc, GrammarUnsupported):
        return str(exc)
    first = (str(exc).splitlines() or [""])[0][:500]  # one that fails on a spec refuses it
    return f"{type(exc).__name__}: {first}"


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _jump_forward_ok(spec: GrammarSpec) -> bool:
    """Whether a spec is decoded with jump-forward (`forced_repeats`); cached, as a cache hit
    must not parse the spec's JSON again."""
    return forced_repeats(spec) <= MAX_FORCED_REPEATS


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}")  # a repetition: {n}, {n,} or {n,m}
_MIN_KEYWORDS = frozenset({"minItems", "minProperties", "minContains"})


def forced_repeats(spec: GrammarSpec) -> int:
    """An upper bound on how often a spec can force one part to repeat: the product of nested
    minimum repetition counts (of all counts in an EBNF grammar or a JSON schema, whose rules
    and $refs nest in ways the text does not show). Stops once past MAX_FORCED_REPEATS.

    NOTE: a backend finds the forced text in one native call on the scheduler's loop, which
    cannot be bounded or interrupted: `((a{1000}){1000}){1000}` or an array with minItems 10^7
    would stall every request for minutes. Such specs are decoded without jump-forward.
    """
    if spec.kind == "regex":
        return _regex_repeats(spec.text)
    if spec.kind == "ebnf":
        counts = [_count(m) for m in _COUNT.finditer(spec.text)]
    elif spec.kind in ("json_schema", "json_object", "structural_tag"):
        counts = _json_min_counts(spec.value)
    else:
        return 1
    product = 1
    for count in counts:
        product *= max(count, 1)
        if product > MAX_FORCED_REPEATS:
            break
    return product


def _count(match: re.Match[str]) -> int:
    digits = match.group(1)
    return int(digits) if len(digits) <= 9 else MAX_FORCED_REPEATS + 1


def _regex_repeats(text: str) -> int:
    """The largest product of counts along a nesting of groups: `(a{10}){10}b{10}` -> 100."""
    inside = [1]  # per open group: the largest product met inside it
    atom = 1  # the product of the atom just read (a count multiplies it)
    i = 0
    while i < len(text):
        c = text[i]
        count = _COUNT.match(text, i) if c == "{" else None
        if count is not None:
            atom = min(atom * _count(count), MAX_FORCED_REPEATS + 1)
            i = count.end()
        elif c == "(":
            inside.append(1)
            atom, i = 1, i + 1
        elif c == ")" and len(inside) > 1:
            atom, i = inside.pop(), i + 1
        elif c == "[":  # a class is one atom
            atom, i = 1, skip_class(text, i + 1)
        else:
            atom, i = 1, i + (2 if c == "\\" else 1)
        inside[-1] = max(inside[-1], atom)
    return max(inside)


def _json_min_counts(value: Any) -> list[int]:
    counts = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, item in node.items():
                if key in _MIN_KEYWORDS and isinstance(item, int) and not isinstance(item, bool):
                    counts.append(item)
                else:
                    stack.append(item)
        elif isinstance(node, list):
            stack.extend(node)
    return counts


def _cut_at_char(data: bytes, limit: int) -> bytes:
    """At most `limit` bytes of `data`, cut before a UTF-8 character's first byte."""
    if len(data) <= limit:
        return data
    end = limit
    while end > 0 and data[end] & 0xC0 == 0x80:  # a continuation byte
        end -= 1
    return data[:end]
