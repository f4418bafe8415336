"""A step's mask fill: the rows of a CPU bitmask, batched per backend, the backends' batches side
by side on their own native threads, and the end-token bits where each grammar may end.

`MaskFill.start` returns at once with the fill running (`FillJob.join` waits for it): the
scheduler lays out its next step meanwhile. `MaskFill.fill` is the same, waited for.
"""

from __future__ import annotations

import threading
from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from weft.grammars.base import GrammarBackend, Matcher
from weft.grammars.bitmask import set_bits_rows
from weft.grammars.daemon_pool import DaemonPool

if TYPE_CHECKING:
    from weft.grammars.manager import RequestGrammar

# (backend, its matchers, their rows): one backend's share of a fill
Group = tuple[GrammarBackend, list[Matcher], list[int]]


class FillJob:
    """A fill in flight: the backends' batches running on the fill pool."""

    def __init__(
        self,
        grammars: list[RequestGrammar],
        rows: list[int],
        bitmask: torch.Tensor,
        members: list[list[int]],
        jobs: list[Future[list[bool]]],
    ) -> None:
        self.grammars = grammars
        self.rows = rows
        self.bitmask = bitmask
        self.members = members  # per job: its indices into grammars
        self.jobs = jobs

    def join(self) -> None:
        """Wait for every backend's batch, then set the end-token bits. Raises what a backend
        raised (after all of them are done: none writes into the bitmask any more)."""
        futures.wait(self.jobs)
        done = [job.result() for job in self.jobs]
        _set_end_bits(self.bitmask, self.grammars, self.rows, self.members, done)


class MaskFill:
    def __init__(self, workers: int) -> None:
        self._pool = DaemonPool(workers, "weft-grammar-fill")

    def fill(self, grammars: list[RequestGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill rows[i] for grammars[i], and wait."""
        self.start(grammars, bitmask, rows, inline=True).join()

    def start(
        self,
        grammars: list[RequestGrammar],
        bitmask: torch.Tensor,
        rows: list[int],
        *,
        inline: bool = False,
    ) -> FillJob:
        """Fill rows[i] for grammars[i]: the backends' batches on the pool's threads; returns
        once each has entered its native code. inline: the first backend's batch on this
        thread, done when this returns (for a caller that waits for the fill next anyway).

        NOTE: a pool thread needs the GIL to reach its native call, and a busy caller lets go of
        it only every sys.getswitchinterval() (5 ms): a fill started and not waited for could
        sit idle the whole time the caller lays out the next step. So wait here until each has
        started (microseconds: the caller blocks, so they take the GIL at once)."""
        members, groups = _groups(grammars, rows)
        if inline:
            first: Future[list[bool]] = Future()
            jobs = [first] + [self._pool.submit(_fill_group, *g, bitmask) for g in groups[1:]]
            try:
                first.set_result(_fill_group(*groups[0], bitmask))
            except Exception as exc:  # (raised by join, once the others are done)
                first.set_exception(exc)
        else:
            started = threading.Semaphore(0)
            jobs = [self._pool.submit(_fill_group, *g, bitmask, started) for g in groups]
            # (a job failed at submit, by a shut-down pool, never starts: join raises its error)
            for _ in [j for j in jobs if not j.done()]:
                started.acquire()
        return FillJob(grammars, rows, bitmask, members, jobs)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _groups(grammars: list[RequestGrammar], rows: list[int]) -> tuple[list[list[int]], list[Group]]:
    """The rows by backend: (each group's indices into grammars, the groups)."""
    by_backend: dict[str, list[int]] = {}
    for i, grammar in enumerate(grammars):
        by_backend.setdefault(grammar.backend_name, []).append(i)
    members = list(by_backend.values())
    groups = [
        (grammars[m[0]].compiled.backend, [grammars[i].matcher for i in m], [rows[i] for i in m])
        for m in members
    ]
    return members, groups


def _fill_group(
    backend: GrammarBackend,
    matchers: list[Matcher],
    rows: list[int],
    bitmask: torch.Tensor,
    started: threading.Semaphore | None = None,
) -> list[bool]:
    """One backend's rows of a step's fill; returns where each may end."""
    if started is not None:
        started.release()  # (see MaskFill.start)
    if len(matchers) > 1:
        backend.fill_many(matchers, bitmask, rows)
    else:
        matchers[0].fill_bitmask(bitmask, rows[0])
    return backend.can_end_many(matchers, bitmask, rows)


def _set_end_bits(
    bitmask: torch.Tensor,
    grammars: list[RequestGrammar],
    rows: list[int],
    members: list[list[int]],
    done: list[list[bool]],
) -> None:
    """End tokens: allowed exactly where the grammar may end (rows grouped by end-token list)."""
    can_end = [False] * len(grammars)
    for group, flags in zip(members, done, strict=True):
        for i, end in zip(group, flags, strict=True):
            can_end[i] = end
    by_ends: dict[tuple[int, ...], tuple[list[int], list[bool]]] = {}
    for grammar, row, end in zip(grammars, rows, can_end, strict=True):
        ends = by_ends.setdefault(tuple(grammar.end_ids), ([], []))
        ends[0].append(row)
        ends[1].append(end)
    for end_ids, (group_rows, flags) in by_ends.items():
        set_bits_rows(bitmask, group_rows, list(end_ids), flags)
