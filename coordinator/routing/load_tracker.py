"""Predicted outstanding work per worker: what the router has sent and the worker has not done.

A route adds its predicted prefill time to the worker's queue; the first token (prefill done)
takes it off again, and a finished request leaves the running set. Predictions are corrected by
what actually happened: the queue never goes negative and a request's share is removed exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel


@dataclass(slots=True)
class _Pending:
    worker: WorkerId
    prefill_ms: float
    prefill_tokens: int
    prefilled: bool = False


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """What a worker itself says it has, from every coordinator (one health interval old)."""

    queued_prefill_tokens: int
    num_requests: int
    """Running and waiting."""


class LoadTracker:
    """Invariants: queued_ms[w] == sum of prefill_ms of w's requests not yet prefilled (>= 0);
    num_running[w] == number of w's requests routed and not finished.

    Own routes are exact but blind to other coordinator replicas; a worker's report sees them
    all but lags. The router takes the larger of the two for each worker (`with_reported`), so
    replicas agree on a worker's load within a health interval and never count a request twice.
    """

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._queued_ms: dict[WorkerId, float] = {}
        self._queued_tokens: dict[WorkerId, int] = {}
        self._num_running: dict[WorkerId, int] = {}
        self._reported: dict[WorkerId, ReportedLoad] = {}

    def on_reported(self, worker: WorkerId, load: ReportedLoad) -> None:
        self._reported[worker] = load

    def with_reported(
        self, worker: WorkerId, tokens_to_ms: Callable[[int], float]
    ) -> tuple[float, int, int]:
        """(queued prefill ms, queued prefill tokens, requests) for routing: the larger of what
        this coordinator routed and what the worker last reported."""
        own_ms, own_tokens = self.queued_prefill_ms(worker), self.queued_prefill_tokens(worker)
        own_running = self.num_running(worker)
        report = self._reported.get(worker)
        if report is None:
            return own_ms, own_tokens, own_running
        return (
            max(own_ms, tokens_to_ms(report.queued_prefill_tokens)),
            max(own_tokens, report.queued_prefill_tokens),
            max(own_running, report.num_requests),
        )

    def columns(
        self, workers: Sequence[WorkerId], cost_model: CostModel
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`with_reported` of every worker at once, as arrays (queued ms, queued tokens,
        requests), with `cost_model.prefill_ms` pricing the reported tokens: the same values."""
        n = len(workers)
        own_ms = np.fromiter((self._queued_ms.get(w, 0.0) for w in workers), np.float64, n)
        own_ms = np.maximum(own_ms, 0.0)
        own_tokens = np.fromiter((self._queued_tokens.get(w, 0) for w in workers), np.int64, n)
        own_running = np.fromiter((self._num_running.get(w, 0) for w in workers), np.int64, n)
        if not self._reported:
            return own_ms, own_tokens, own_running
        reports = [self._reported.get(w) for w in workers]
        has = np.fromiter((r is not None for r in reports), bool, n)
        tokens = np.fromiter((r.queued_prefill_tokens if r else 0 for r in reports), np.int64, n)
        running = np.fromiter((r.num_requests if r else 0 for r in reports), np.int64, n)
        reported_ms = cost_model.prefill_ms_array(tokens)
        return (
            np.where(has, np.maximum(own_ms, reported_ms), own_ms),
            np.where(has, np.maximum(own_tokens, tokens), own_tokens),
            np.where(has, np.maximum(own_running, running), own_running),
        )

    def queued_prefill_ms(self, worker: WorkerId) -> float:
        return max(0.0, self._queued_ms.get(worker, 0.0))

    def queued_prefill_tokens(self, worker: WorkerId) -> int:
        return self._queued_tokens.get(worker, 0)

    def num_running(self, worker: WorkerId) -> int:
        return self._num_running.get(worker, 0)

    def on_routed(self, request_id: str, worker: WorkerId, prefill_ms: float, tokens: int) -> None:
        if request_id in self._pending:
            raise ValueError("a request with this id is already in flight")  # never echo ids
        self._pending[request_id] = _Pending(worker, prefill_ms, tokens)
        self._queued_ms[worker] = self._queued_ms.get(worker, 0.0) + prefill_ms
        self._queued_tokens[worker] = self._queued_tokens.get(worker, 0) + tokens
        self._num_running[worker] = self._num_running.get(worker, 0) + 1

    def on_prefilled(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is None or p.prefilled:
            return
        p.prefilled = True
        self._queued_ms[p.worker] = max(0.0, self._queued_ms[p.worker] - p.prefill_ms)
        self._queued_tokens[p.worker] = max(0, self._queued_tokens[p.worker] - p.prefill_tokens)

    def on_finished(self, request_id: str) -> None:
        self.on_prefilled(request_id)
        p = self._pending.pop(request_id, None)
        if p is not None:
            self._num_running[p.worker] -= 1

    def forget_worker(self, worker: WorkerId) -> list[str]:
        """Drop a dead worker's requests; returns their ids."""
        ids = [rid for rid, p in self._pending.items() if p.worker == worker]
        for rid in ids:
            del self._pending[rid]
        self._queued_ms.pop(worker, None)
        self._queued_tokens.pop(worker, None)
        self._num_running.pop(worker, None)
        self._reported.pop(worker, None)
        return ids

    def check_invariants(self) -> None:
        for w, n in self._num_running.items():
            assert n == sum(1 for p in self._pending.values() if p.worker == w), w
            expected = sum(
                p.prefill_ms for p in self._pending.values() if p.worker == w and not p.prefilled
            )
            assert abs(self.queued_prefill_ms(w) - expected) < 1e-6 * max(1.0, expected), w
