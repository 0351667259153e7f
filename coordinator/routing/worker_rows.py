"""Row numbers for workers, so that per-worker numbers can live in numpy arrays.

The router reads a number per worker for every worker on every decision; a dict lookup per
worker is what made pricing O(fleet) in Python. Here each worker known to a table owns a row of
its columns, and the rows of a whole fleet (the registry's routable tuple, which rarely changes)
are looked up once and cached, so a read is one gather per column:

    ids (tuple, cached) ──rows()──► [r0, r1, -1, r3, ...] ──gather()──► column[rows] (0 where -1)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId


class WorkerRows:
    """Columns of per-worker numbers, a row per worker that has any.

    Invariants: rows in use and free rows are disjoint and together are range(num_rows); every
    column has at least num_rows entries; a released row is zero in every column. Write through
    `set` / `add` (or take `row()` before reading `columns`): making a row may replace them.
    """

    def __init__(self, **dtypes: type) -> None:
        self._row_of: dict[WorkerId, int] = {}
        self._free: list[int] = []
        self._num_rows = 0
        self.columns: dict[str, np.ndarray] = {n: np.zeros(64, dtype=d) for n, d in dtypes.items()}
        self._cached: tuple[Sequence[WorkerId], np.ndarray] | None = None

    def __contains__(self, worker: WorkerId) -> bool:
        return worker in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def get(self, worker: WorkerId) -> int | None:
        return self._row_of.get(worker)

    def row(self, worker: WorkerId) -> int:
        """The worker's row, made (all zeros) if it has none."""
        row = self._row_of.get(worker)
        if row is not None:
            return row
        if self._free:
            row = self._free.pop()
        else:
            row = self._num_rows
            self._num_rows += 1
            size = len(next(iter(self.columns.values())))
            if row >= size:
                for name, col in self.columns.items():
                    grown = np.zeros(2 * size, dtype=col.dtype)
                    grown[:size] = col
                    self.columns[name] = grown
        self._row_of[worker] = row
        self._cached = None
        return row

    def set(self, name: str, worker: WorkerId, value: float) -> None:
        row = self.row(worker)  # first: making a row may grow (replace) the columns
        self.columns[name][row] = value

    def add(self, name: str, worker: WorkerId, delta: float) -> None:
        row = self.row(worker)  # first, as in `set`
        self.columns[name][row] += delta

    def add_at(self, name: str, row: int, delta: float) -> None:
        """`add` to a row already taken (`row()`), without looking the worker up."""
        self.columns[name][row] += delta

    def rows_in_use(self) -> list[int]:
        """The rows that belong to a worker now."""
        return list(self._row_of.values())

    def value(self, name: str, worker: WorkerId) -> float | int | bool:
        """The worker's number in column `name` as a Python scalar (0 without a row)."""
        row = self._row_of.get(worker)
        return 0 if row is None else self.columns[name][row].item()

    def release(self, worker: WorkerId) -> None:
        row = self._row_of.pop(worker, None)
        if row is None:
            return
        for col in self.columns.values():
            col[row] = 0
        self._free.append(row)
        self._cached = None

    def rows(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """Each worker's row, made (zeros) for those without one: the fleet being routed to is
        the fleet whose numbers are kept. Cached for the last fleet asked about."""
        cached = self._cached
        if cached is not None and (cached[0] is workers or cached[0] == workers):
            return cached[1]
        rows = np.fromiter((self.row(w) for w in workers), np.int64, len(workers))
        self._cached = (workers if isinstance(workers, tuple) else tuple(workers), rows)
        return rows

    def gather(self, name: str, workers: Sequence[WorkerId]) -> np.ndarray:
        """Column `name` for each worker in order (0 for a worker that had no row)."""
        rows = self.rows(workers)  # first: making rows may grow (replace) the columns
        return self.columns[name][rows]

    def check_invariants(self) -> None:
        used = set(self._row_of.values())
        assert not used & set(self._free), "a free row is in use"
        assert used | set(self._free) == set(range(self._num_rows))
        for name, col in self.columns.items():
            assert len(col) >= self._num_rows, name
            for row in self._free:
                assert col[row] == 0, (name, row)
