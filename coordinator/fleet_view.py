"""What the router sees of the fleet for one prompt: each routable worker's pool, free blocks,
load and held prefix of the prompt's chain, as `WorkerColumns` (the mirror's match written
straight into the columns)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from kvmesh.coordinator.contract import PrefixIndex
from kvmesh.coordinator.index.mirror import PrefixMatch, WorkerId
from kvmesh.coordinator.prompt_preparer import PreparedPrompt
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_tracker import LoadTracker
from kvmesh.coordinator.routing.policy import WorkerColumns

FreeBlocksMany = Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray]]
"""workers -> (pool blocks, free blocks) of each, in order."""


class FleetView:
    """Reads the index, the load tracker (under its owner's lock) and the workers' free blocks;
    writes none of them. While the index is disconnected, or for a prompt that bypasses the
    cache, nothing is matched: a stale index must not steer traffic (routing is by load only).

    Invariant: the cached rows, if any, are those of the last fleet tuple seen (row i is its
    worker i)."""

    def __init__(
        self,
        mirror: PrefixIndex,
        load: LoadTracker,
        *,
        index_connected: Callable[[], bool] = lambda: True,
        worker_free_blocks: Callable[[str], tuple[int, int]] | None = None,
        worker_free_blocks_many: FreeBlocksMany | None = None,
    ) -> None:
        self.mirror = mirror
        self.load = load
        self.index_connected = index_connected
        self._worker_free_blocks = worker_free_blocks or (lambda _w: (1 << 30, 1 << 30))
        # The same for a whole fleet at once, when the caller can (the simulator); else per worker.
        self._worker_free_blocks_many = worker_free_blocks_many
        self._fleet_rows: tuple[tuple[WorkerId, ...], dict[WorkerId, int]] | None = None

    def match(self, prompt: PreparedPrompt) -> dict[WorkerId, PrefixMatch]:
        if prompt.bypass_cache:
            return {}
        if not self.index_connected():
            return {}  # a stale index must not steer traffic: route by load only
        return self.mirror.match(prompt.block_hashes)

    def columns(
        self, prompt: PreparedPrompt, workers: Sequence[str], cost_model: CostModel
    ) -> WorkerColumns:
        """Every routable worker as the router sees it for this prompt, as columns."""
        ids = cast(tuple[WorkerId, ...], tuple(workers))
        if self._worker_free_blocks_many is not None:
            num_blocks, num_free = self._worker_free_blocks_many(ids)
        else:
            capacity = [self._worker_free_blocks(w) for w in ids]
            num_blocks = np.array([c[0] for c in capacity], dtype=np.int64)
            num_free = np.array([c[1] for c in capacity], dtype=np.int64)
        queued_ms, queued_tokens, running = self.load.columns(ids, cost_model)
        index_of = self._index_of(ids)
        if prompt.bypass_cache or not self.index_connected():  # as `match`: nothing matched
            num_matched = np.zeros(len(ids), dtype=np.int64)
            num_device = np.zeros(len(ids), dtype=np.int64)
        else:
            num_matched, num_device, _ = self.mirror.match_fleet(
                prompt.block_hashes, index_of, len(ids), prompt.block_hash_array
            )
        return WorkerColumns(
            ids,
            num_blocks,
            num_free,
            queued_ms,
            queued_tokens,
            running,
            num_matched,
            num_device,
            index_of,
            self.load.num_queued_many(ids),
        )

    def _index_of(self, ids: tuple[WorkerId, ...]) -> dict[WorkerId, int]:
        """Row of each worker of the fleet, cached while the fleet stays the same tuple."""
        cached = self._fleet_rows
        if cached is None or cached[0] is not ids:
            cached = self._fleet_rows = (ids, {w: i for i, w in enumerate(ids)})
        return cached[1]

    def check_invariants(self) -> None:
        if self._fleet_rows is not None:
            ids, rows = self._fleet_rows
            assert rows == {w: i for i, w in enumerate(ids)}, "cached rows are not the fleet's"
