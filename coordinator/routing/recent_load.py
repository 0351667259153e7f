"""What the router has recently sent to each worker: decayed sums of predicted work and requests.

The queue term of the router's cost sees only work not yet done. Where a new prefix lands,
though, the requests that will share it follow; a worker that has been *given* more lately will
keep receiving more. These sums remember the recent past with an exponential horizon:

    value(t) = sum over routed requests r of  x_r * exp(-(t - t_r) / horizon_s)

Each worker's sums are decayed lazily (on read or update), so the cost is O(1) per worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.coordinator.index.mirror import WorkerId


@dataclass(slots=True)
class _Sums:
    work_ms: float
    num_requests: float
    at_s: float


class RecentLoad:
    """Decayed per-worker sums of routed work (ms) and routed requests.

    Invariant: every stored sum is >= 0 and was last decayed to its `at_s`.
    """

    def __init__(self, horizon_s: float = 10.0) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = horizon_s
        self._sums: dict[WorkerId, _Sums] = {}

    def _decayed(self, worker: WorkerId, now_s: float) -> _Sums:
        s = self._sums.get(worker)
        if s is None:
            return _Sums(0.0, 0.0, now_s)
        if now_s > s.at_s:
            f = math.exp(-(now_s - s.at_s) / self.horizon_s)
            return _Sums(s.work_ms * f, s.num_requests * f, now_s)
        return s

    def work_ms(self, worker: WorkerId, now_s: float) -> float:
        return self._decayed(worker, now_s).work_ms

    def num_requests(self, worker: WorkerId, now_s: float) -> float:
        return self._decayed(worker, now_s).num_requests

    def snapshot(self, workers: list[WorkerId], now_s: float) -> tuple[list[float], list[float]]:
        """(work_ms, num_requests) of each worker at `now_s`, in order; one pass, no allocation
        per worker (the router calls this for every worker on every decision)."""
        work, requests = [], []
        sums, horizon, exp = self._sums, self.horizon_s, math.exp
        for w in workers:
            s = sums.get(w)
            if s is None:
                work.append(0.0)
                requests.append(0.0)
                continue
            f = exp((s.at_s - now_s) / horizon) if now_s > s.at_s else 1.0
            work.append(s.work_ms * f)
            requests.append(s.num_requests * f)
        return work, requests

    def add(self, worker: WorkerId, work_ms: float, now_s: float) -> None:
        """One request routed to `worker`, predicted to cost `work_ms` there."""
        if work_ms < 0:
            raise ValueError(f"work_ms must be >= 0, got {work_ms}")
        s = self._decayed(worker, now_s)
        self._sums[worker] = _Sums(s.work_ms + work_ms, s.num_requests + 1.0, now_s)

    def forget(self, worker: WorkerId) -> None:
        self._sums.pop(worker, None)

    def check_invariants(self) -> None:
        for w, s in self._sums.items():
            assert s.work_ms >= 0 and s.num_requests >= 0, w
