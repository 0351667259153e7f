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

    An entry is keyed by one int, the prefix's last hash (64 bits) plus the worker's row of
    `_sums` above them: ints are never walked by the garbage collector, where a tuple key and
    value per routed prompt would be, each time it runs while they are young.

    Invariants (checked by `check_invariants`): the "num_blocks" column of a worker is the sum of
    its entries' lengths; entries are ordered by last use; at most `max_entries` are kept; every
    entry's row is a worker's row in use.
    """

    def __init__(self, horizon_s: float = 10.0, max_entries: int = 100_000) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.horizon_s = horizon_s
        self.max_entries = max_entries
        # key -> last use (insertion order is last-use order); key -> num_blocks
        self._last_use: OrderedDict[int, float] = OrderedDict()
        self._length: dict[int, int] = {}
        self._sums = WorkerRows(num_blocks=np.int64)
        # The last fleet's `num_blocks_many` and the count of `_sums` changes it was read at:
        # returned again while no sum changed (a reuse of a prefix as long as before changes none).
        self._num_changes = 0
        self._many: tuple[Sequence[WorkerId], int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._last_use)

    def add(self, worker: WorkerId, last_hash: BlockHash, num_blocks: int, now_s: float) -> None:
        """`num_blocks` leading blocks of a prompt, ending with `last_hash`, reused on `worker`."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not 0 <= last_hash < 1 << 64:
            raise ValueError(f"a block hash is 64 bits, got {last_hash}")
        row = self._sums.row(worker)
        key = last_hash | row << 64
        before = self._length.get(key, 0)
        if before:
            del self._last_use[key]  # to the end: the last used
        length = max(before, num_blocks)
        self._last_use[key] = now_s
        self._length[key] = length
        if length != before:
            self._sums.add_at("num_blocks", row, length - before)
            self._num_changes += 1
        if len(self._last_use) > self.max_entries:
            self._drop_oldest()

    def expire(self, now_s: float) -> None:
        """Drop the prefixes not reused within `horizon_s` of `now_s`."""
        last_use, cutoff = self._last_use, now_s - self.horizon_s
        while last_use and next(iter(last_use.values())) <= cutoff:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key, _ = self._last_use.popitem(last=False)
        self._sums.add_at("num_blocks", key >> 64, -self._length.pop(key))
        self._num_changes += 1

    def num_blocks(self, worker: WorkerId) -> int:
        return int(self._sums.value("num_blocks", worker))

    def num_blocks_many(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`num_blocks` of each worker, in order (0 for a worker with none), read only: the
        same array while no sum changed and the same fleet is asked (so a caller may keep what
        it made of it while it gets this array back)."""
        many = self._many
        if (
            many is not None
            and many[1] == self._num_changes
            and (many[0] is workers or many[0] == workers)
        ):
            return many[2]
        blocks = self._sums.gather("num_blocks", workers)
        blocks.flags.writeable = False
        self._many = (
            workers if isinstance(workers, tuple) else tuple(workers),
            self._num_changes,
            blocks,
        )
        return blocks

    def forget_worker(self, worker: WorkerId) -> None:
        row = self._sums.get(worker)
        if row is None:
            return
        for key in [k for k in self._last_use if k >> 64 == row]:
            del self._last_use[key]
            del self._length[key]
        self._sums.release(worker)
        self._num_changes += 1

    def check_invariants(self) -> None:
        self._sums.check_invariants()
        assert self._last_use.keys() == self._length.keys(), "entries and lengths differ"
        sums: dict[int, int] = {}
        last = float("-inf")
        for key, at_s in self._last_use.items():
            row, length = key >> 64, self._length[key]
            assert length >= 1 and at_s >= last, (row, length, at_s)
            sums[row] = sums.get(row, 0) + length
            last = at_s
        in_use = set(self._sums.rows_in_use())
        for row, total in sums.items():
            assert row in in_use, f"row {row} is not a worker's"
            assert self._sums.columns["num_blocks"][row] == total, (row, total)
        assert len(self._last_use) <= self.max_entries
        many = self._many
        if many is not None and many[1] == self._num_changes:
            column, row_of = self._sums.columns["num_blocks"], self._sums.get
            fresh = [0 if (r := row_of(w)) is None else int(column[r]) for w in many[0]]
            assert many[2].tolist() == fresh, "the kept fleet's sums are stale"
