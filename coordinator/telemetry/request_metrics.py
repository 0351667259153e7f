"""Request-level metrics the coordinator's own counters do not keep: outcomes and latencies.

Token totals (prompt / cached / pulled / computed) stay with the coordinator's counters, their
one owner; this observer adds what only the end of a request knows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvmesh.coordinator.telemetry.histogram import (
    DECISION_BUCKETS_S,
    DISPATCH_BUCKETS_S,
    LATENCY_BUCKETS_S,
    Histogram,
    HistogramSnapshot,
)
from kvmesh.coordinator.telemetry.request_record import OUTCOMES, RequestRecord


@dataclass(frozen=True, slots=True)
class RequestMetricsSnapshot:
    outcome_to_count: dict[str, int]
    """Every outcome in OUTCOMES, zero included (a series should exist before its first event)."""
    ttft: HistogramSnapshot
    routing_decision: HistogramSnapshot
    dispatch: HistogramSnapshot


class RequestMetrics:
    """A `RequestObserver`. Invariant: the sum of outcome counts is the number of records seen."""

    def __init__(
        self,
        ttft_bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S,
        decision_bounds_s: tuple[float, ...] = DECISION_BUCKETS_S,
    ) -> None:
        self._outcome_to_count = dict.fromkeys(OUTCOMES, 0)
        self._num_records = 0
        self._ttft = Histogram(ttft_bounds_s)
        self._decision = Histogram(decision_bounds_s)
        self._dispatch = Histogram(DISPATCH_BUCKETS_S)
        self._lock = threading.Lock()

    def on_routed(self, seconds: float) -> None:
        self._decision.observe(seconds)

    def on_request_done(self, record: RequestRecord) -> None:
        with self._lock:
            self._outcome_to_count[record.outcome] += 1
            self._num_records += 1
        if record.ttft_s is not None:
            self._ttft.observe(record.ttft_s)
        if record.dispatch_s is not None:
            self._dispatch.observe(record.dispatch_s)

    def snapshot(self) -> RequestMetricsSnapshot:
        with self._lock:
            outcomes = dict(self._outcome_to_count)
        return RequestMetricsSnapshot(
            outcomes, self._ttft.snapshot(), self._decision.snapshot(), self._dispatch.snapshot()
        )

    def check_invariants(self) -> None:
        with self._lock:
            assert sum(self._outcome_to_count.values()) == self._num_records
        self._ttft.check_invariants()
        self._decision.check_invariants()
        self._dispatch.check_invariants()
