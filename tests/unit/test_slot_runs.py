"""Host slots sorted into runs of consecutive slots: one strided copy per run and layer."""

from __future__ import annotations

import pytest

from kvmesh.workers.kv.slot_runs import SlotRun, slot_runs


def test_consecutive_slots_in_any_order_make_runs_in_sorted_rows() -> None:
    got = slot_runs([17, 3, 4, 18, 5, 40])
    assert got.order == [1, 2, 4, 0, 3, 5]
    assert got.runs == [SlotRun(0, 3, 3), SlotRun(3, 17, 2), SlotRun(5, 40, 1)]


def test_descending_slots_are_one_run() -> None:
    got = slot_runs([9, 8, 7, 6])
    assert got.order == [3, 2, 1, 0]
    assert got.runs == [SlotRun(0, 6, 4)]


def test_every_row_of_every_run_is_the_slot_it_names() -> None:
    slots = [50, 2, 51, 3, 90, 1, 52, 7]
    got = slot_runs(slots)
    rows = [slots[i] for i in got.order]
    assert sum(r.num_slots for r in got.runs) == len(slots)
    for run in got.runs:
        assert rows[run.first_row : run.first_row + run.num_slots] == list(
            range(run.first_slot, run.first_slot + run.num_slots)
        )


@pytest.mark.parametrize("slots", [[4, 2, 4], [-1, 0]])
def test_repeated_or_negative_slots_are_refused(slots: list[int]) -> None:
    with pytest.raises(ValueError, match="distinct"):
        slot_runs(slots)
