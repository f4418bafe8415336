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
    decode = [r for r in steps if r["masked_rows"] == 2]
    assert decode, "no step masked both rows"
    for r in decode:
        assert {"forward", "logits", "mask", "sampling"} <= r["seg_ms"].keys()
        assert r["host_s"]["fill_s"] > 0
        assert all(ms >= 0 for ms in r["seg_ms"].values())
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
