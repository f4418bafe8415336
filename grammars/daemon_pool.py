"""A thread pool whose threads never delay the process's exit (grammar compiles, mask fills)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]  # a future, fn, args


class DaemonPool:
    """A thread pool whose threads never delay the process's exit.

    NOTE: concurrent.futures' pool joins its threads at exit, and a grammar compile that hangs
    in native code (the reason for the timeout) would then hang the exit forever.
    """

    def __init__(self, workers: int, name: str) -> None:
        self.name = name
        self._closed = False
        self._lock = threading.Lock()  # orders `submit` against `shutdown`
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """A future of fn(*args); after `shutdown`, one that fails at once (no worker is left
        to run it, and a waiter must not wait forever)."""
        future: Future[Any] = Future()
        with self._lock:
            closed = self._closed
            if not closed:
                self._jobs.put((future, fn, args))
        if closed:
            future.set_exception(RuntimeError(f"the {self.name} pool is shut down"))
        return future

    @property
    def backlog(self) -> int:
        """Jobs submitted and not yet taken by a thread."""
        return self._jobs.qsize()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """The jobs submitted so far still run; then the threads end."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
