"""The mirror's worker bits: each worker known to it owns one bit of the holder sets' masks
(`holder_sets.py`), and a fleet being routed to reads its workers' matches by the bits' rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from kvmesh.coordinator.index.mirror import WorkerId

NO_POSITION = 64  # `FleetBits.positions` of a row whose worker has no bit
MAX_KEPT_MASKS = 4096  # holder sets' rows a fleet keeps (`FleetBits.rows_of`)


class FleetBits(NamedTuple):
    """The rows of the workers' bits in one fleet, as the mirror's fleet match reads them."""

    row_of: Mapping[WorkerId, int]
    num_rows: int
    row_of_bit: dict[int, int]
    """Each worker bit's row (bits of workers outside the fleet left out)."""
    positions: np.ndarray | None
    """Each row's bit position (`NO_POSITION`: a worker without a bit), while every worker's
    bit, in the fleet or not, is below 64 (None past that)."""
    rows_of_mask: dict[int, np.ndarray]
    """The rows of a holder set's workers, by its mask (`rows_of`), as they are asked for."""

    def rows_of(self, mask: int) -> np.ndarray:
        """The rows (int64, in bit order) of the fleet's workers among `mask`'s bits, kept for
        the fleet: the few holder sets that hold a prompt's head come back decision after
        decision. At most `MAX_KEPT_MASKS` are kept (then they are found again)."""
        rows = self.rows_of_mask.get(mask)
        if rows is None:
            if len(self.rows_of_mask) >= MAX_KEPT_MASKS:
                self.rows_of_mask.clear()
            row_of_bit, found = self.row_of_bit, []
            m = mask
            while m:
                low = m & -m
                row = row_of_bit.get(low)
                if row is not None:
                    found.append(row)
                m ^= low
            rows = self.rows_of_mask[mask] = np.array(found, dtype=np.int64)
        return rows


class WorkerBits:
    """Worker <-> bit (a power of two), the lowest free bit given to a new worker.

    Invariants (checked by `check_invariants`): the two maps are each other's inverse; every
    bit is a power of two; the kept fleet, if any, was made from the current bits.
    """

    def __init__(self) -> None:
        self.bit_of: dict[WorkerId, int] = {}
        self.worker_of_bit: dict[int, WorkerId] = {}
        # The rows of the last fleet read (`fleet`), until another fleet comes or a bit is
        # given or taken.
        self._fleet: FleetBits | None = None

    def __len__(self) -> int:
        return len(self.bit_of)

    def get(self, worker: WorkerId) -> int | None:
        return self.bit_of.get(worker)

    def bit(self, worker: WorkerId) -> int:
        """The worker's bit, given (the lowest free one) if it has none."""
        bit = self.bit_of.get(worker)
        if bit is None:
            used = 0
            for b in self.worker_of_bit:
                used |= b
            bit = ~used & (used + 1)  # lowest free bit
            self.bit_of[worker] = bit
            self.worker_of_bit[bit] = worker
            self._fleet = None
        return bit

    def release(self, worker: WorkerId) -> int:
        """Take the worker's bit back (the holder sets must hold it nowhere); 0 if it had none."""
        bit = self.bit_of.pop(worker, 0)
        if bit:
            del self.worker_of_bit[bit]
            self._fleet = None
        return bit

    def fleet(self, row_of: Mapping[WorkerId, int], num_rows: int) -> FleetBits:
        """The rows of the workers' bits in the fleet `row_of` of `num_rows` workers, kept
        while the same `row_of` object comes: another fleet is another mapping, never the same
        one changed."""
        cached = self._fleet
        if cached is None or cached.row_of is not row_of or cached.num_rows != num_rows:
            rows = {b: row_of[w] for b, w in self.worker_of_bit.items() if w in row_of}
            positions = None
            if all(b < 1 << NO_POSITION for b in self.worker_of_bit):  # the fleet's and others'
                positions = np.full(num_rows, NO_POSITION, dtype=np.int64)
                for b, r in rows.items():
                    positions[r] = b.bit_length() - 1
            cached = self._fleet = FleetBits(row_of, num_rows, rows, positions, {})
        return cached

    def check_invariants(self) -> None:
        assert len(self.bit_of) == len(self.worker_of_bit), "the maps differ in size"
        for w, bit in self.bit_of.items():
            assert self.worker_of_bit[bit] == w, f"{w}'s bit maps to another worker"
            assert bit > 0 and not bit & (bit - 1), f"{w}'s bit {bit} is not a power of two"
        fleet = self._fleet
        if fleet is not None:
            rows = {b: fleet.row_of[w] for b, w in self.worker_of_bit.items() if w in fleet.row_of}
            assert fleet.row_of_bit == rows, "the kept fleet's rows are not its workers' bits'"
            for mask, kept in fleet.rows_of_mask.items():
                bits = [b for b in rows if b & mask]
                assert sorted(kept.tolist()) == sorted(rows[b] for b in bits), "kept rows drifted"
