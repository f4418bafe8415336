"""Observation counts per bucket, for a process without a metrics registry (the scheduler).

An observation costs a bisect and two additions; the HTTP process fetches a `snapshot()` when
/metrics is scraped and serves it as a Prometheus histogram.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any


class BucketCounts:
    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must increase strictly, got {list(bounds)}")
        self.bounds = tuple(bounds)  # upper bounds (inclusive), then one bucket above the last
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """Plain data for a message: {"bounds", "counts" (per bucket, not cumulative), "sum"}."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}
