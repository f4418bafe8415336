"""The thread that steps `weft.Engine`'s scheduler, and hands results back to the callers.

The Engine's half that runs requests: an inbox of the scheduler's own messages (plus calls to
run between steps), one step at a time under a lock, on the engine thread or on a main thread
that blocks in `generate` (`_drive`), and each step's progress delivered to its waiters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias, assert_never

from weft.runtime.core import Req
from weft.runtime.intake import RequestError
from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.results import request_output
from weft.runtime.scheduler import Scheduler

logger = logging.getLogger("weft")


@dataclass
class _Pending:
    """A request as the caller sees it: one prompt, n samples."""

    n: int
    reqs: list[Req] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # streaming: gets each chunk (built on the engine thread), then None at the end
    on_update: Callable[[dict[str, Any] | None], None] | None = None
    final_only: bool = False  # only the last chunk of each sample (async_generate)

    @property
    def finished(self) -> bool:
        return len(self.reqs) == self.n and all(r.finished for r in self.reqs)


@dataclass
class _Submit:
    """New requests (one message, so the scheduler sees a batch at once) and their waiters."""

    msg: to_sched.Generate
    pendings: list[_Pending]


@dataclass
class _Call:
    """A function to run on the engine thread between steps (`Engine.call`)."""

    fn: Callable[[], Any]
    box: dict[str, Any] = field(default_factory=dict)  # its "value", or the "error" it raised
    done: threading.Event = field(default_factory=threading.Event)


_Inbox: TypeAlias = _Submit | to_sched.Abort | _Call


class EngineThread:
    """The stepping half of `weft.Engine` (a base class: the Engine sets `scheduler`, then calls
    `_start_thread`)."""

    scheduler: Scheduler

    def _start_thread(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._inbox: list[_Inbox] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._step_lock = threading.Lock()  # one scheduler step at a time, whichever thread
        self._foreground = 0  # callers stepping the scheduler on their own thread (see _drive)
        self._stepper: int | None = None  # the thread inside _run_once (see _check_not_stepping)
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="weft-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the thread that steps the scheduler, between steps, and return its result.

        Called from that thread itself (inside a function given to `call`), fn runs at once,
        inline: it is between steps already, and posting fn would wait for itself forever."""
        if self._stepper == threading.get_ident():
            return fn()
        item = _Call(fn)
        self._post(item)
        while not item.done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
        if "error" in item.box:
            raise item.box["error"]
        return item.box["value"]

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self.scheduler.close()

    def _submit(
        self,
        reqs: list[GenerateRequest],
        on_update: Callable[[dict[str, Any] | None], None] | None = None,
        final_only: bool = False,
    ) -> list[_Pending]:
        pendings = [
            _Pending(req.params.n, on_update=on_update, final_only=final_only) for req in reqs
        ]
        self._post(_Submit(to_sched.Generate(reqs), pendings))
        return pendings

    def _post(self, item: _Inbox) -> None:
        with self._cv:
            if self._broken is not None:
                raise RuntimeError(f"the engine failed earlier: {self._broken}") from self._broken
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self._inbox.append(item)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (
                    self._foreground or (not self._inbox and not self.scheduler.has_work)
                ):
                    self._cv.wait()
                if self._stopped:
                    break
            if not self._run_once():
                return
        with self._step_lock:
            self._fail_all(RuntimeError("the engine was shut down"), [])

    def _run_once(self) -> bool:
        """Handle the inbox, then run one scheduler step; False once the engine has failed."""
        with self._step_lock:
            if self._broken is not None:
                return False
            self._stepper = threading.get_ident()
            with self._cv:
                inbox, self._inbox = self._inbox, []
            try:
                while inbox:
                    self._handle(inbox.pop(0))
                if self.scheduler.has_work:
                    self._dispatch(self.scheduler.step())
            except BaseException as exc:
                logger.exception("engine step failed")
                with self._cv:
                    self._broken = exc
                self._fail_all(exc, inbox)
                return False
            finally:
                self._stepper = None
        return True

    def _check_not_stepping(self, name: str) -> None:
        """Refuse a blocking request from the thread that runs the steps it would wait for."""
        if self._stepper == threading.get_ident():
            raise RuntimeError(
                f"Engine.{name}() was called on the engine's own thread (inside a function "
                "given to Engine.call): it would wait for a step only this thread can run. "
                "Call it from another thread (e.g. a concurrent.futures.ThreadPoolExecutor), "
                "or, inside call(), use engine.scheduler directly"
            )

    def _drive(self, pendings: list[_Pending]) -> None:
        """Run the steps on this (the main) thread until these requests are done.

        NOTE: measured on a 2-core CPU, torch's OpenMP kernels run ~25 % slower when called from
        a thread other than the main one, so a blocking generate() on the main thread steps the
        scheduler itself; the engine thread sleeps meanwhile (`_foreground`).
        """
        with self._cv:
            self._foreground += 1
        try:
            while not all(p.done.is_set() for p in pendings):
                with self._cv:
                    idle = not self._inbox and not self.scheduler.has_work
                if self._stopped or idle or not self._run_once():
                    break
        finally:
            with self._cv:
                self._foreground -= 1
                self._cv.notify()

    def _handle(self, item: _Inbox) -> None:
        match item:
            case _Submit(msg=msg, pendings=pendings):
                for req, pending in zip(msg.reqs, pendings, strict=True):
                    self._add(req, pending)
            case to_sched.Abort(rids=rids):
                for rid in rids:
                    self.scheduler.abort(rid)
            case _Call(fn=fn, box=box, done=done):
                try:
                    box["value"] = fn()
                except Exception as exc:
                    box["error"] = exc
                done.set()
            case _:
                assert_never(item)

    def _add(self, req: GenerateRequest, pending: _Pending) -> None:
        if req.rid in self._pending:
            self._reject(pending, RequestError(f"rid {req.rid!r} is already in use", "rid"))
            return
        try:
            pending.reqs = self.scheduler.add(Req.from_message(req))
        except Exception as exc:  # this request only; the others go on
            self._reject(pending, exc)
            return
        self._pending[req.rid] = pending

    def _dispatch(self, reqs: list[Req]) -> None:
        """Hand a step's progress to the callers (on the engine thread, right after the step).

        NOTE: a request ends only after every update of the step went out: the samples of an
        n > 1 request that finish in the same step each send their last chunk first."""
        ended: dict[str, _Pending] = {}
        for req in reqs:
            key = req.group_rid or req.rid
            pending = self._pending.get(key)
            if pending is None:
                continue
            if pending.on_update is not None and (req.finished or not pending.final_only):
                # (the text without a held-back stop-string prefix)
                text = req.decoder.text[: req.sent_len] if req.decoder is not None else None
                chunk = request_output(req, key, text)
                if not pending.final_only:  # a stream chunk, as the server's: which sample
                    chunk["index"] = req.index
                if not self._notify(pending, chunk):
                    # the caller went away (its event loop closed): stop generating for it
                    del self._pending[key]
                    ended.pop(key, None)
                    self.scheduler.abort(key)
                    continue
            if pending.finished:
                ended[key] = pending
        for key, pending in ended.items():
            del self._pending[key]
            self._notify(pending, None)
            pending.done.set()

    @staticmethod
    def _notify(pending: _Pending, chunk: dict[str, Any] | None) -> bool:
        if pending.on_update is None:
            return True
        try:
            pending.on_update(chunk)
        except RuntimeError:
            return False
        return True

    def _reject(self, pending: _Pending, exc: BaseException) -> None:
        pending.error = exc
        self._notify(pending, None)
        pending.done.set()

    def _fail_all(self, exc: BaseException, unhandled: list[_Inbox]) -> None:
        """Every waiter hears about it: running requests, and messages not handled yet."""
        for pending in self._pending.values():
            self._reject(pending, exc)
        self._pending.clear()
        with self._cv:
            unhandled, self._inbox = unhandled + self._inbox, []
        stopped = RuntimeError(f"engine stopped: {exc}")
        for item in unhandled:
            match item:
                case _Submit(pendings=pendings):
                    for pending in pendings:
                        self._reject(pending, stopped)
                case _Call(box=box, done=done):
                    box["error"] = stopped
                    done.set()
                case to_sched.Abort():
                    pass
                case _:
                    assert_never(item)

    def _collect(self, pending: _Pending) -> list[dict[str, Any]]:
        if pending.error is not None:
            raise failure(pending.error)
        for r in pending.reqs:
            if r.finish is not None and r.finish.status is not None:
                # a 4xx: the request's own fault (a bad grammar); a 5xx: a grammar backend failed
                error = ValueError if r.finish.status < 500 else RuntimeError
                raise error(r.finish.message)
        return [
            request_output(r, r.group_rid or r.rid)
            for r in sorted(pending.reqs, key=lambda r: r.index)
        ]


def failure(error: BaseException) -> BaseException:
    """A request's own error (bad input) as itself; an engine failure wrapped."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"generation failed: {error}")
