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
    """`slots` sorted into runs of consecutive slots; raises on a repeated or negative slot."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    runs: list[SlotRun] = []
    previous = -1
    for row, i in enumerate(order):
        slot = slots[i]
        if slot <= previous or slot < 0:
            raise ValueError(f"slots must be distinct and >= 0, got {slot} after {previous}")
        if runs and previous == slot - 1:
            runs[-1] = runs[-1]._replace(num_slots=runs[-1].num_slots + 1)
        else:
            runs.append(SlotRun(row, slot, 1))
        previous = slot
    return SlotOrder(order, runs)
