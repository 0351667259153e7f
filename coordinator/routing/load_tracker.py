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
from kvmesh.coordinator.routing.worker_rows import WorkerRows


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
    num_queued[w] == number of them; num_running[w] == number of w's requests routed and not
    finished.

    Own routes are exact but blind to other coordinator replicas; a worker's report sees them
    all but lags. The router takes the larger of the two for each worker (`with_reported`), so
    replicas agree on a worker's load within a health interval and never count a request twice.
    The per-worker numbers live in `WorkerRows` columns, so `columns` reads a fleet at once.
    """

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._rows = WorkerRows(
            queued_ms=np.float64,
            queued_tokens=np.int64,
            num_running=np.int64,
            num_queued=np.int64,
            reported=np.bool_,
            reported_tokens=np.int64,
            reported_requests=np.int64,
        )
        self._num_reports = 0
        # The reports of the last fleet priced: they change only with a report (or the cost
        # model), not with every route. (cost model, reports seen, rows, `_reported`)
        self._reported_ms: (
            tuple[CostModel, int, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]
            | None
        ) = None

    def on_reported(self, worker: WorkerId, load: ReportedLoad) -> None:
        self._rows.set("reported", worker, True)
        self._num_reports += 1
        self._rows.set("reported_tokens", worker, load.queued_prefill_tokens)
        self._rows.set("reported_requests", worker, load.num_requests)

    def with_reported(
        self, worker: WorkerId, tokens_to_ms: Callable[[int], float]
    ) -> tuple[float, int, int]:
        """(queued prefill ms, queued prefill tokens, requests) for routing: the larger of what
        this coordinator routed and what the worker last reported."""
        own_ms, own_tokens = self.queued_prefill_ms(worker), self.queued_prefill_tokens(worker)
        own_running = self.num_running(worker)
        if not self._rows.value("reported", worker):
            return own_ms, own_tokens, own_running
        tokens = int(self._rows.value("reported_tokens", worker))
        return (
            max(own_ms, tokens_to_ms(tokens)),
            max(own_tokens, tokens),
            max(own_running, int(self._rows.value("reported_requests", worker))),
        )

    def columns(
        self, workers: Sequence[WorkerId], cost_model: CostModel
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`with_reported` of every worker at once, as arrays (queued ms, queued tokens,
        requests), with `cost_model.prefill_ms` pricing the reported tokens: the same values."""
        rows = self._rows.rows(workers)  # first: making rows may grow (replace) the columns
        col = self._rows.columns
        own_ms = np.maximum(col["queued_ms"][rows], 0.0)
        own_tokens = col["queued_tokens"][rows]
        own_running = col["num_running"][rows]
        reported = self._reported(rows, cost_model)
        if reported is None:
            return own_ms, own_tokens, own_running
        # A worker without a report reports 0 tokens and 0 requests, and its own numbers are
        # >= 0: the max below leaves them as they are, as `with_reported` does.
        reported_ms, tokens, requests = reported
        return (
            np.maximum(own_ms, reported_ms),
            np.maximum(own_tokens, tokens),
            np.maximum(own_running, requests),
        )

    def _reported(
        self, rows: np.ndarray, cost_model: CostModel
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The fleet's reports: (tokens priced, 0 where none was reported; tokens; requests),
        None if no worker of it reported. Kept until the next report, another fleet (rows) or
        another cost model: reports come once a health interval, routes many times in it."""
        cached = self._reported_ms
        if (
            cached is None
            or cached[0] is not cost_model
            or cached[1] != self._num_reports
            or cached[2] is not rows
        ):
            col = self._rows.columns
            has = col["reported"][rows]
            reported = None
            if np.count_nonzero(has):
                tokens = col["reported_tokens"][rows]
                reported_ms = np.where(has, cost_model.prefill_ms_array(tokens), 0.0)
                reported = (reported_ms, tokens, col["reported_requests"][rows])
            cached = self._reported_ms = (cost_model, self._num_reports, rows, reported)
        return cached[3]

    def queued_prefill_ms(self, worker: WorkerId) -> float:
        return max(0.0, float(self._rows.value("queued_ms", worker)))

    def queued_prefill_tokens(self, worker: WorkerId) -> int:
        return int(self._rows.value("queued_tokens", worker))

    def num_running(self, worker: WorkerId) -> int:
        return int(self._rows.value("num_running", worker))

    def num_queued(self, worker: WorkerId) -> int:
        """Requests this coordinator routed to the worker that have not had their first token
        (waiting or prefilling); workers' reports do not carry it."""
        return int(self._rows.value("num_queued", worker))

    def num_queued_many(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`num_queued` of each worker, in order, as one array."""
        return self._rows.gather("num_queued", workers)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def on_routed(self, request_id: str, worker: WorkerId, prefill_ms: float, tokens: int) -> None:
        if request_id in self._pending:
            raise ValueError("a request with this id is already in flight")  # never echo ids
        self._pending[request_id] = _Pending(worker, prefill_ms, tokens)
        rows = self._rows
        row = rows.row(worker)  # first: making a row may grow (replace) the columns
        rows.add_at("queued_ms", row, prefill_ms)
        rows.add_at("queued_tokens", row, tokens)
        rows.add_at("num_running", row, 1)
        rows.add_at("num_queued", row, 1)

    def on_prefilled(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is None or p.prefilled:
            return
        p.prefilled = True
        self._rows.add("num_queued", p.worker, -1)
        queued_ms = float(self._rows.value("queued_ms", p.worker))
        self._rows.set("queued_ms", p.worker, max(0.0, queued_ms - p.prefill_ms))
        queued_tokens = int(self._rows.value("queued_tokens", p.worker))
        self._rows.set("queued_tokens", p.worker, max(0, queued_tokens - p.prefill_tokens))

    def on_finished(self, request_id: str) -> None:
        self.on_prefilled(request_id)
        p = self._pending.pop(request_id, None)
        if p is not None:
            self._rows.add("num_running", p.worker, -1)

    def forget_worker(self, worker: WorkerId) -> list[str]:
        """Drop a dead worker's requests; returns their ids."""
        ids = [rid for rid, p in self._pending.items() if p.worker == worker]
        for rid in ids:
            del self._pending[rid]
        self._rows.release(worker)
        return ids

    def check_invariants(self) -> None:
        self._rows.check_invariants()
        workers = {p.worker for p in self._pending.values()}
        for w in workers:
            n = self.num_running(w)
            assert n == sum(1 for p in self._pending.values() if p.worker == w), w
            queued = sum(1 for p in self._pending.values() if p.worker == w and not p.prefilled)
            assert self.num_queued(w) == queued, w
            expected = sum(
                p.prefill_ms for p in self._pending.values() if p.worker == w and not p.prefilled
            )
            assert abs(self.queued_prefill_ms(w) - expected) < 1e-6 * max(1.0, expected), w
