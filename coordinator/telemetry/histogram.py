"""A cumulative histogram with fixed upper bounds, the shape Prometheus exposes.

bounds:        b_0      b_1      ...      b_{n-1}     +Inf
counts[i]:     number of observations <= b_i (cumulative); the +Inf bucket is `count`
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
"""TTFT: from a cached prefill on a GPU (ms) to a long cold prefill on a CPU worker (s)."""

DISPATCH_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
"""A request's way from the coordinator to its worker: ~1-2 ms on one host; the buckets resolve
the few ms a loaded path adds."""

DECISION_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
"""Routing decisions: the goal is p99 under 1 ms, so the buckets straddle it."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    """cumulative_counts[i]: observations <= bounds[i]."""
    count: int
    total: float
    """Sum of all observations."""


class Histogram:
    """Invariants: bounds strictly increase; `_counts` (per bucket, not cumulative) has one slot
    per bound plus one for +Inf, and sums to `_count`."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"bounds must be non-empty and strictly increasing, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._count = 0
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is <=).
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._count += 1
            self._total += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, count, total = list(self._counts), self._count, self._total
        cumulative: list[int] = []
        running = 0
        for c in counts[:-1]:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), count, total)

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._counts) == len(self.bounds) + 1
            assert sum(self._counts) == self._count
