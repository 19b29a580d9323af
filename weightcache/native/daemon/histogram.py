"""The one histogram the daemon keeps (attach, update and pause durations), in the shape the
node agent reads from `stats` and exports to Prometheus: cumulative buckets, then +Inf."""

from __future__ import annotations

from typing import Any


class Histogram:
    """Cumulative buckets over fixed `bounds` (seconds); not locked: callers hold theirs."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count, self.sum = 0, 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "buckets": [[b, c] for b, c in zip(self.bounds, self.counts, strict=True)]
            + [["+Inf", self.count]],
            "sum": self.sum,
            "count": self.count,
        }
