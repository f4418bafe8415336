"""The lock beside a cache entry: processes that build the same entry at once take turns, and
no lock file stays behind."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from weft.runtime.loaders.cache_lock import cache_lock


def _build(entry: str, log: str, name: str) -> None:
    with cache_lock(Path(entry)), open(log, "a") as f:
        f.write(f"{name} in\n")
        f.flush()
        time.sleep(0.2)  # another process, unlocked, would write in between
        f.write(f"{name} out\n")


def test_builders_take_turns_and_leave_no_lock(tmp_path):
    entry, log = tmp_path / "model-bfloat16", tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build, args=(str(entry), str(log), f"p{i}")) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = log.read_text().split()
    pairs = [lines[i : i + 4] for i in range(0, len(lines), 4)]
    assert len(pairs) == 3
    for name, state_in, same, state_out in pairs:
        assert (state_in, state_out, same) == ("in", "out", name)
    assert sorted(p[0] for p in pairs) == ["p0", "p1", "p2"]
    assert list(tmp_path.iterdir()) == [log]  # no <entry>.lock
