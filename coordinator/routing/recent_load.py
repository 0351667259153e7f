"""What the router has recently sent to each worker: decayed sums of predicted work and requests.

The queue term of the router's cost sees only work not yet done. Where a new prefix lands,
though, the requests that will share it follow; a worker that has been *given* more lately will
keep receiving more. These sums remember the recent past with an exponential horizon:

    value(t) = sum over routed requests r of  x_r * exp(-(t - t_r) / horizon_s)

Each worker's sums are decayed lazily (on read or update), so the cost is O(1) per worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId

_WORK, _REQUESTS, _AT = 0, 1, 2  # rows of `RecentLoad._sums`


@dataclass(slots=True)
class _Sums:
    work_ms: float
    num_requests: float
    at_s: float


class RecentLoad:
    """Decayed per-worker sums of routed work (ms) and routed requests.

    Invariant: every stored sum is >= 0 and was last decayed to its `at_s`. Each worker with a
    sum, or of a fleet read, owns a row of three arrays (`_slot_of`; sums of 0 read as none), so
    the router reads a whole fleet's sums with one gather (`snapshot_arrays`) instead of a
    lookup per worker.
    """

    def __init__(self, horizon_s: float = 10.0) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = horizon_s
        self._slot_of: dict[WorkerId, int] = {}
        self._free_slots: list[int] = []
        # Rows _WORK, _REQUESTS, _AT of one array: a fleet's sums are one gather.
        self._sums = np.zeros((3, 0))
        # The row index of the last fleet asked for (the live fleet rarely changes).
        self._rows_for: tuple[tuple[WorkerId, ...], np.ndarray] | None = None
        # The latest time a sum was stored at (0.0: the time of a row of zeros).
        self._latest_at_s = 0.0

    def _stored(self, worker: WorkerId) -> _Sums | None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return None
        work, num_requests, at_s = self._sums[:, slot].tolist()
        return _Sums(work, num_requests, at_s)

    def _decayed(self, worker: WorkerId, now_s: float) -> _Sums:
        s = self._stored(worker)
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
        """(work_ms, num_requests) of each worker at `now_s`, in order, one worker at a time
        (the reference that `snapshot_arrays` must agree with)."""
        work, requests = [], []
        horizon, exp = self.horizon_s, math.exp
        for w in workers:
            s = self._stored(w)
            if s is None:
                work.append(0.0)
                requests.append(0.0)
                continue
            f = exp((s.at_s - now_s) / horizon) if now_s > s.at_s else 1.0
            work.append(s.work_ms * f)
            requests.append(s.num_requests * f)
        return work, requests

    def snapshot_arrays(
        self, workers: Sequence[WorkerId], now_s: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """`snapshot` of a whole fleet at once, as arrays (to within an ulp: numpy's exp)."""
        n = len(workers)
        if not self._slot_of:
            zeros = np.zeros((2, n))
            return zeros[_WORK], zeros[_REQUESTS]
        rows = self._rows(tuple(workers))  # first: making rows may grow (replace) `_sums`
        sums = self._sums.take(rows, axis=1)  # a copy: decayed in place below
        exponent = sums[_AT]
        exponent -= now_s
        if now_s < self._latest_at_s:
            # min(at - now, 0): the factor is 1 for a sum stored after now (a clock that went
            # back), as `snapshot` has it; the same floats as a `where` on `now > at`. Where no
            # sum is stored after now, every at - now is <= 0 (+0.0 at now) and it is itself.
            np.minimum(exponent, 0.0, out=exponent)
        exponent /= self.horizon_s
        f = np.exp(exponent, out=exponent)
        # (a row at a time: a broadcast over both rows costs more than two; rows read by index,
        # not by unpacking the array, which iterates it)
        work, requests = sums[_WORK], sums[_REQUESTS]
        work *= f
        requests *= f
        return work, requests

    def _rows(self, workers: tuple[WorkerId, ...]) -> np.ndarray:
        """Each worker's row, made (sums of 0, which read as no sums) for those without one,
        so that routing to a worker of the fleet keeps this cached for the last fleet."""
        cached = self._rows_for
        if cached is not None and (cached[0] is workers or cached[0] == workers):
            return cached[1]
        rows = np.fromiter((self._slot(w) for w in workers), np.int64, len(workers))
        self._rows_for = (workers, rows)
        return rows

    def _slot(self, worker: WorkerId) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            slot = self._slot_of[worker] = self._new_slot()
            self._sums[:, slot] = 0.0
        return slot

    def add(self, worker: WorkerId, work_ms: float, now_s: float) -> None:
        """One request routed to `worker`, predicted to cost `work_ms` there."""
        if work_ms < 0:
            raise ValueError(f"work_ms must be >= 0, got {work_ms}")
        slot = self._slot(worker)  # a new row leaves the cached fleet's rows valid
        sums = self._sums
        work, num_requests, at_s = sums[:, slot].tolist()
        if now_s > at_s:  # `_decayed`, on the row's numbers
            f = math.exp(-(now_s - at_s) / self.horizon_s)
            work, num_requests = work * f, num_requests * f
        sums[_WORK, slot] = work + work_ms
        sums[_REQUESTS, slot] = num_requests + 1.0
        sums[_AT, slot] = now_s
        if now_s > self._latest_at_s:
            self._latest_at_s = now_s

    def _new_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        slot = len(self._slot_of)
        if slot >= self._sums.shape[1]:
            grown = np.zeros((3, max(64, 2 * self._sums.shape[1])))
            grown[:, : self._sums.shape[1]] = self._sums
            self._sums = grown
        return slot

    def forget(self, worker: WorkerId) -> None:
        slot = self._slot_of.pop(worker, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._rows_for = None

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values())
        assert len(set(slots)) == len(slots), "two workers share a row"
        assert not set(slots) & set(self._free_slots), "a free row is in use"
        for w, slot in self._slot_of.items():
            assert self._sums[_WORK, slot] >= 0 and self._sums[_REQUESTS, slot] >= 0, w
            assert self._sums[_AT, slot] <= self._latest_at_s, "a sum after the latest time"
