"""The prefixes each worker's cache was lately reused for: its working set, in blocks.

A block that a placement evicts costs something only if a later request would have reused it.
Where the prefixes a worker's traffic keeps reusing fill a small part of its pool, the LRU end
of the pool holds what nobody asks for again (one-off prompts, finished answers); where they
approach the pool's size, the LRU end is a prefix due again soon. The router cannot see a pool's
LRU order, but it sees every prompt it routes and how much of it the chosen worker holds (or is
given by a pull). So it keeps, per worker, each reused prefix (keyed by the hash of its last
reused block) with its length, until `horizon_s` after its last reuse:

    working_set(w) = sum of the lengths of the distinct prefixes reused on w within horizon_s

    reuse on w ──► entry (w, last hash): length, last use ──► horizon_s without reuse: dropped

Two prefixes of one chain (a conversation's turns) are two entries, so a chain reused turn after
turn within the horizon is counted more than once: an overestimate, on the side of keeping
caches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.worker_rows import WorkerRows
from kvmesh.proto.block_hash import BlockHash


class ReusedPrefixes:
    """Per worker, the distinct prefixes reused there lately and the sum of their blocks.

    Invariants (checked by `check_invariants`): the "num_blocks" column of a worker is the sum of
    its entries' lengths; entries are ordered by last use; at most `max_entries` are kept.
    """

    def __init__(self, horizon_s: float = 10.0, max_entries: int = 100_000) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.horizon_s = horizon_s
        self.max_entries = max_entries
        # (worker, last hash) -> (num_blocks, last use); insertion order is last-use order.
        self._entries: OrderedDict[tuple[WorkerId, BlockHash], tuple[int, float]] = OrderedDict()
        self._sums = WorkerRows(num_blocks=np.int64)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, worker: WorkerId, last_hash: BlockHash, num_blocks: int, now_s: float) -> None:
        """`num_blocks` leading blocks of a prompt, ending with `last_hash`, reused on `worker`."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        key = (worker, last_hash)
        old = self._entries.pop(key, None)
        before = 0 if old is None else old[0]
        length = max(before, num_blocks)
        self._entries[key] = (length, now_s)
        if length != before:
            self._sums.add("num_blocks", worker, length - before)
        if len(self._entries) > self.max_entries:
            self._drop_oldest()

    def expire(self, now_s: float) -> None:
        """Drop the prefixes not reused within `horizon_s` of `now_s`."""
        entries, cutoff = self._entries, now_s - self.horizon_s
        while entries and next(iter(entries.values()))[1] <= cutoff:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        (worker, _), (length, _) = self._entries.popitem(last=False)
        self._sums.add("num_blocks", worker, -length)

    def num_blocks(self, worker: WorkerId) -> int:
        return int(self._sums.value("num_blocks", worker))

    def num_blocks_many(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`num_blocks` of each worker, in order (0 for a worker with none)."""
        return self._sums.gather("num_blocks", workers)

    def forget_worker(self, worker: WorkerId) -> None:
        for key in [k for k in self._entries if k[0] == worker]:
            del self._entries[key]
        self._sums.release(worker)

    def check_invariants(self) -> None:
        self._sums.check_invariants()
        sums: dict[WorkerId, int] = {}
        last = float("-inf")
        for (worker, _), (length, at_s) in self._entries.items():
            assert length >= 1 and at_s >= last, (worker, length, at_s)
            sums[worker] = sums.get(worker, 0) + length
            last = at_s
        for worker, total in sums.items():
            assert self.num_blocks(worker) == total, (worker, total)
        assert len(self._entries) <= self.max_entries
