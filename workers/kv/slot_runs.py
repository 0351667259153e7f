"""Runs of consecutive host slots: how many strided copies a promotion's layer takes.

A promotion reads host slots in the order its blocks come; sorted, consecutive slots form runs,
and one run of one layer is one strided copy (`CopyEngine.host_to_device_2d`). The copies land in
a staging buffer in sorted order, row r holding the slot at sorted position r:

    slots (request order)   [17, 3, 4, 18, 5, 40]
    sorted rows             [ 3, 4, 5, 17, 18, 40]    order = [1, 2, 4, 0, 3, 5]
    runs                    (row 0, slot 3, 3)  (row 3, slot 17, 2)  (row 5, slot 40, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class SlotRun(NamedTuple):
    first_row: int
    """Staging row of the run's first slot (its position in sorted order)."""
    first_slot: int
    num_slots: int


class SlotOrder(NamedTuple):
    order: list[int]
    """order[r]: the index into the request's slots of the slot at sorted row r."""
    runs: list[SlotRun]


def slot_runs(slots: Sequence[int]) -> SlotOrder:
    """`slots` sorted into runs of consecutive slots; raises on a repeated or negative slot.

    On a host hit's path (a promotion's few hundred slots, before its first copy): array
    operations, one Python object per run, not per slot."""
    values = np.asarray(slots, dtype=np.int64)
    if not values.size:
        return SlotOrder([], [])
    order = np.argsort(values, kind="stable")
    rows = values[order]
    steps = np.diff(rows)
    bad = np.flatnonzero(steps <= 0)
    if rows[0] < 0 or bad.size:
        at = int(bad[0]) + 1 if rows[0] >= 0 else 0
        after = int(rows[at - 1]) if at else -1
        raise ValueError(f"slots must be distinct and >= 0, got {int(rows[at])} after {after}")
    starts = np.flatnonzero(np.concatenate(([True], steps != 1)))
    ends = np.append(starts[1:], rows.size)
    runs = [SlotRun(int(r), int(rows[r]), int(e - r)) for r, e in zip(starts, ends, strict=True)]
    return SlotOrder(order.tolist(), runs)
