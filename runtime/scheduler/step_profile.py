"""Per-step timings for benchmarks (EngineConfig.profile_steps): where a step's time goes on the
device's timeline, and the host time of the grammar work.

A step's *marks* are points on the device's timeline, each named after the segment it ends:

| mark       | recorded                                | its segment (from the mark before)        |
|------------|-----------------------------------------|-------------------------------------------|
| `sched`    | before the forward is launched          | the host between steps (scheduling, batch |
|            |                                         | layout; without overlap, the accepts too) |
| `forward`  | after the forward is launched           | the forward                               |
| `readback` | after a step's sampled ids are on host  | waiting for the read-back                 |
| `accept`   | after their accepts (grammar, output)   | accepts the device waited for             |
| `host`     | before the logits are launched          | other host work (prompt logprobs, cache)  |
| `logits`   | after the logits are launched           | the lm_head                               |
| `mask`     | after the mask fill (and its H2D copy)  | the device waiting for the grammar masks  |
| `sampling` | after the sampling is launched          | the sampling                              |

Their order varies (under the overlap schedule the previous step's read-back sits between the
forward and the logits, and its mask and sampling between the layout and the forward: a step's
masks are filled while the next one is laid out; without it, at the end of the step), so
segments are summed by name, and
a step's first segment starts at the previous step's last mark. The segments of a step add up to
its time on the device's timeline.

On CUDA a mark is an event: the device reaches it when it has run all the work launched before it
*and* the host has recorded it, so a segment is the device's own work in it plus the time it sat
idle waiting for the host to launch the next thing. A segment between marks with no launch in
between (`mask`: only the bitmask's H2D copy) is therefore the device-idle time the host caused.
On a CPU a mark is the host clock: the "device" is the host, and every host segment is on the
critical path.

Host timings (perf_counter, seconds): `fill_s` in Constrained.fill_bitmask, `readback_s`
waiting for sampled ids, `accept_s` appending them (grammar accepts, take_draft, think, output).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

MAX_RECORDS = 1 << 16  # NOTE: bounded: a server run with profile_steps keeps the latest only


class StepProfile:
    """The no-op twin (profile_steps off): every method is a cheap call that records nothing."""

    enabled = False

    def begin(self) -> None:
        """A scheduler step starts."""

    def mark(self, name: str) -> None:
        """A point on the device's timeline, ending the segment `name` (see the table)."""

    def host(self, key: str, since: float) -> None:
        """Host seconds from `since` (a perf_counter value) to now, added to the step's `key`."""

    def count(self, key: str, value: int) -> None:
        """A count of the step (rows sampled, rows masked, tokens through the model)."""

    def end(self) -> None:
        """The step is over: kept if it recorded anything."""

    def take(self) -> list[dict[str, Any]]:
        """The steps recorded so far, oldest first, and forget them (waits for the device)."""
        return []


class StepRecorder(StepProfile):
    """Records every step: {"step", "marks" (names in order), "seg_ms" {segment: ms},
    "host_ms" {segment: the host's ms between the same marks}, "host_s" {key: s}, counts...}. CUDA events are read lazily: a step's are turned into
    milliseconds once its last event has completed (queried, never waited for in a step)."""

    enabled = True

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_RECORDS)
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._last: Any = None  # the previous step's last mark: the next step's first segment
        self._step = 0
        self._current: dict[str, Any] | None = None

    def begin(self) -> None:
        self._step += 1
        self._current = {"step": self._step, "marks": [], "points": [], "stamps": [], "host_s": {}}

    def mark(self, name: str) -> None:
        if self._current is None:
            return
        if self.cuda:
            point: Any = torch.cuda.Event(enable_timing=True)
            point.record()
        else:
            point = time.perf_counter()
        self._current["marks"].append(name)
        self._current["points"].append(point)
        self._current["stamps"].append(time.perf_counter())

    def host(self, key: str, since: float) -> None:
        if self._current is not None:
            seconds = self._current["host_s"]
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - since

    def count(self, key: str, value: int) -> None:
        if self._current is not None:
            self._current[key] = self._current.get(key, 0) + value

    def end(self) -> None:
        record, self._current = self._current, None
        if record is not None and (record["marks"] or record["host_s"]):
            record["first"] = self._last  # (None: the first step since `take`)
            if record["points"]:
                self._last = (record["points"][-1], record["stamps"][-1])
            self._pending.append(record)
        self._settle(wait=False)

    def take(self) -> list[dict[str, Any]]:
        self._settle(wait=True)
        records = list(self.records)
        self.records.clear()
        self._last = None  # the next step's first segment would span the pause
        return records

    def _settle(self, *, wait: bool) -> None:
        """Turn the pending steps whose marks the device has reached into milliseconds."""
        while self._pending:
            record = self._pending[0]
            last = record["points"][-1] if record["points"] else None
            if self.cuda and last is not None:
                if wait:
                    last.synchronize()
                elif not last.query():
                    return
            self._pending.popleft()
            self.records.append(self._segments(record))

    def _segments(self, record: dict[str, Any]) -> dict[str, Any]:
        seg: dict[str, float] = {}
        host: dict[str, float] = {}
        first = record.pop("first")
        prev, prev_stamp = first if first is not None else (None, None)
        marks = zip(record["marks"], record.pop("points"), record.pop("stamps"), strict=True)
        for name, point, stamp in marks:
            if prev is not None:
                ms = prev.elapsed_time(point) if self.cuda else (point - prev) * 1e3
                seg[name] = seg.get(name, 0.0) + ms
                host[name] = host.get(name, 0.0) + (stamp - prev_stamp) * 1e3
            prev, prev_stamp = point, stamp
        record["seg_ms"] = seg
        record["host_ms"] = host
        return record


def step_profile(enabled: bool, device: torch.device) -> StepProfile:
    return StepRecorder(device) if enabled else StepProfile()
