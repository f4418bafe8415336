"""EngineConfig.profile_steps: per-step segments and host timings (CPU clock here; the CUDA
events follow the same bookkeeping), and nothing recorded when off."""

from __future__ import annotations

import pytest

from conftest import make_engine

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.mark.parametrize("overlap", [False, True])
def test_segments_of_constrained_steps(stories_dir, overlap):
    engine = make_engine(
        stories_dir, max_total_tokens=2048, profile_steps=True, enable_overlap_schedule=overlap
    )
    params = {"temperature": 0, "max_new_tokens": 12, "json_schema": SCHEMA}
    engine.generate(input_ids=[[1, 300, 301], [1, 302]], sampling_params=params)
    records = engine.call(engine.scheduler.profile.take)
    steps = [r for r in records if "forward" in r["seg_ms"]]
    assert steps and all(r["rows"] >= 1 for r in steps)
    decode = [j for j, r in enumerate(records) if r.get("masked_rows") == 2]
    assert decode, "no step masked both rows"
    for j in decode:
        r = records[j]
        assert {"forward", "logits"} <= r["seg_ms"].keys()
        assert r["host_s"]["fill_s"] > 0
        assert all(ms >= 0 for ms in r["seg_ms"].values())
        # under the overlap schedule the step samples in the next one (after its layout)
        sampled = records[j + 1] if "mask" not in r["seg_ms"] else r
        assert {"mask", "sampling"} <= sampled["seg_ms"].keys()
    # every read-back is timed, on its own step's record or the next one's
    accepts = sum(1 for r in records if "accept_s" in r["host_s"])
    assert accepts >= len(steps)
    assert engine.call(engine.scheduler.profile.take) == []  # taken: forgotten
    engine.shutdown()


def test_off_by_default(stories_dir):
    engine = make_engine(stories_dir, max_total_tokens=2048)
    assert not engine.scheduler.profile.enabled
    engine.generate(input_ids=[[1, 300]], sampling_params={"max_new_tokens": 3})
    assert engine.scheduler.profile.take() == []
    engine.shutdown()


class _FakeEvent:
    """A CUDA event on a fake device timeline: `at` is the device clock (ms) it stands for;
    done once the test says the device got there."""

    clock = 0.0
    reached = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def query(self) -> bool:
        return self.at is not None and self.at <= _FakeEvent.reached

    def synchronize(self) -> None:
        _FakeEvent.reached = max(_FakeEvent.reached, self.at)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not reached"
        return end.at - self.at


def test_cuda_events_read_lazily(monkeypatch):
    """On CUDA a step's milliseconds come from its events once the device has passed them (never
    waiting in a step); the first segment starts at the previous step's last event."""
    import torch

    from weft.runtime.scheduler import step_profile
    from weft.runtime.scheduler.step_profile import StepRecorder

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    host_clock = [0.0]  # seconds: the host's own time between the marks differs from the device's
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: host_clock[0])
    _FakeEvent.clock = _FakeEvent.reached = 0.0
    prof = StepRecorder(torch.device("cuda"))
    marks = (
        ("sched", 1.0, 0.75),
        ("forward", 10.0, 0.25),
        ("mask", 3.0, 2.0),
        ("sampling", 0.5, 0.5),
    )
    for _ in range(2):
        prof.begin()
        for name, ms, host_ms in marks:
            _FakeEvent.clock += ms
            host_clock[0] += host_ms / 1e3
            prof.mark(name)
        prof.count("rows", 4)
        prof.end()
        assert not prof.records  # the device has not got there: pending, not waited for
    _FakeEvent.reached = 14.5  # the first step's last event
    prof.begin()
    prof.end()  # (a step with no marks is not kept; it settles the pending ones)
    assert [r["step"] for r in prof.records] == [1]
    first = prof.records[0]["seg_ms"]
    assert first == {"forward": 10.0, "mask": 3.0, "sampling": 0.5}  # no previous step
    records = prof.take()  # waits for the rest
    assert records[1]["seg_ms"] == {"sched": 1.0, "forward": 10.0, "mask": 3.0, "sampling": 0.5}
    host = {"sched": 0.75, "forward": 0.25, "mask": 2.0, "sampling": 0.5}
    assert records[1]["host_ms"] == pytest.approx(host)
    assert records[0]["host_ms"] == pytest.approx({k: v for k, v in host.items() if k != "sched"})
    assert records[1]["rows"] == 4 and not prof.records
