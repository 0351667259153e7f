"""Pool size and free blocks of a simulated fleet's workers, as the coordinator reads them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.workers.kv.block_pool import BlockPool


class FleetPools:
    """Pool size and free blocks of a fleet's workers as arrays (the coordinator's
    `worker_free_blocks_many`). A pool's free count changes only when its worker admits or
    advances, so the simulation `refresh`es it there and a decision reads a whole fleet with
    one gather, not a property per worker.

    Invariant: free[i] == pools[i].num_free whenever the coordinator reads it."""

    def __init__(self, worker_ids: Sequence[WorkerId], pools: Sequence[BlockPool]) -> None:
        self._pools = list(pools)
        self._row_of = {w: i for i, w in enumerate(worker_ids)}
        self._sizes = np.fromiter((p.num_blocks for p in pools), np.int64, len(pools))
        self._free = np.fromiter((p.num_free for p in pools), np.int64, len(pools))
        self._shared = len({id(p) for p in pools}) == 1  # the oracle's lanes share one pool
        self._fleet: tuple[Sequence[str], np.ndarray] | None = None

    def refresh(self, w: int) -> None:
        """Worker `w`'s pool may have changed."""
        if self._shared:
            self._free.fill(self._pools[w].num_free)
        else:
            self._free[w] = self._pools[w].num_free

    def __call__(self, workers: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._fleet is None or (self._fleet[0] is not workers and self._fleet[0] != workers):
            rows = np.fromiter((self._row_of[WorkerId(w)] for w in workers), np.int64)
            self._fleet = (workers, rows)
        rows = self._fleet[1]
        return self._sizes[rows], self._free[rows]
