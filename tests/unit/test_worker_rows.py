"""Per-worker numbers kept in numpy rows, and the load tracker's fleet read built on them."""

from __future__ import annotations

import random

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_tracker import LoadTracker, ReportedLoad
from kvmesh.coordinator.routing.worker_rows import WorkerRows


def test_rows_grow_and_a_released_row_comes_back_zeroed() -> None:
    rows = WorkerRows(x=float)
    ids = tuple(WorkerId(f"w{i}") for i in range(200))  # past the initial 64 rows
    for i, w in enumerate(ids):
        rows.set("x", w, i + 1.0)
    assert rows.gather("x", ids).tolist() == [i + 1.0 for i in range(200)]
    rows.release(ids[5])
    rows.check_invariants()
    assert rows.gather("x", (ids[5], ids[6])).tolist() == [0.0, 7.0]  # re-made as zeros
    rows.check_invariants()


def test_the_cached_fleet_lookup_follows_new_and_released_workers() -> None:
    rows = WorkerRows(x=int)
    fleet = (WorkerId("a"), WorkerId("b"))
    assert rows.gather("x", fleet).tolist() == [0, 0]
    rows.set("x", WorkerId("b"), 3)
    assert rows.gather("x", fleet).tolist() == [0, 3]
    rows.release(WorkerId("b"))
    assert rows.gather("x", fleet).tolist() == [0, 0]
    rows.check_invariants()


def test_load_columns_equal_each_workers_with_reported() -> None:
    rng, cm = random.Random(0), CostModel()
    tracker = LoadTracker()
    fleet = tuple(WorkerId(f"w{i}") for i in range(90))
    for k in range(400):
        w = rng.choice(fleet)
        action = rng.random()
        if action < 0.5:
            tracker.on_routed(f"r{k}", w, rng.random() * 40, rng.randrange(500))
        elif action < 0.7:
            tracker.on_prefilled(f"r{rng.randrange(k + 1)}")
        elif action < 0.85:
            tracker.on_finished(f"r{rng.randrange(k + 1)}")
        elif action < 0.98:
            tracker.on_reported(w, ReportedLoad(rng.randrange(2000), rng.randrange(9)))
        else:
            tracker.forget_worker(w)
        if k % 5 == 0:  # often: the priced reports are kept between reports
            if k % 100 == 0:
                cm = cm.with_measured_prefill(rng.random() * 0.1)  # and between cost models
            queued_ms, queued_tokens, running = tracker.columns(fleet, cm)
            for i, w in enumerate(fleet):
                expected = tracker.with_reported(w, cm.prefill_ms)
                assert (queued_ms[i], queued_tokens[i], running[i]) == expected
    tracker.check_invariants()
