"""The oracle's prefix index: every lane holds whatever the one shared pool holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvmesh.coordinator.index.mirror import FleetMatch, PrefixMatch, WorkerId
from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv.block_pool import BlockPool


class SharedPoolIndex:
    """The oracle's index: every lane holds whatever the one shared pool holds."""

    def __init__(self, pool: BlockPool, workers: Sequence[WorkerId]) -> None:
        self.pool = pool
        self.workers = list(workers)
        self.num_events_applied = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_cached

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        held = len(self.pool.match_prefix(hashes))
        return dict.fromkeys(self.workers, PrefixMatch(held, held)) if held else {}

    def match_fleet(
        self,
        hashes: Sequence[BlockHash],
        row_of: Mapping[WorkerId, int],
        num_rows: int,
        hash_array: np.ndarray | None = None,
    ) -> FleetMatch:
        held = len(self.pool.match_prefix(hashes))
        num_blocks = np.zeros(num_rows, dtype=np.int64)
        num_blocks[[row_of[w] for w in self.workers if w in row_of]] = held
        return FleetMatch(num_blocks, num_blocks.copy(), held)

    def num_worker_blocks(self, worker: WorkerId) -> int:
        return self.pool.num_cached
