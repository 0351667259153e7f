"""The load-only terms of kvmesh's cost, kept between decisions while the load columns stay."""

from __future__ import annotations

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_terms import LoadTermCache, LoadTerms, load_terms
from kvmesh.coordinator.routing.policy import WorkerColumns


def columns(free: list[int], running: list[int], queued: list[int] | None = None) -> WorkerColumns:
    n = len(free)
    zeros = np.zeros(n, dtype=np.int64)
    return WorkerColumns(
        tuple(WorkerId(f"w{i}") for i in range(n)),
        np.full(n, 100, dtype=np.int64),
        np.array(free),
        np.zeros(n),
        zeros,
        np.array(running),
        zeros,
        zeros,
        num_queued=None if queued is None else np.array(queued),
    )


def same(a: LoadTerms, b: LoadTerms) -> bool:
    """Field by field, arrays bit for bit."""
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if x is None or y is None or x.tobytes() != y.tobytes():
                return False
        elif x != y:
            return False
    return True


def test_terms_are_kept_while_the_same_numbers_come_in_new_arrays() -> None:
    cache, cm = LoadTermCache(), CostModel()
    first = cache.terms(columns([10, 100], [0, 3]), cm)
    assert cache.terms(columns([10, 100], [0, 3]), cm) is first
    assert same(first, load_terms(columns([10, 100], [0, 3]), cm))


def test_terms_are_priced_again_when_a_column_changes_even_in_place() -> None:
    cache, cm = LoadTermCache(), CostModel()
    cols = columns([10, 100], [0, 3])
    first = cache.terms(cols, cm)
    cols.num_free_blocks[0] = 50  # the same array, other numbers
    again = cache.terms(cols, cm)
    assert again is not first and same(again, load_terms(cols, cm))
    queued = columns([50, 100], [0, 3], queued=[0, 2])
    assert same(cache.terms(queued, cm), load_terms(queued, cm))
    assert cache.terms(queued, cm).any_queued


def test_terms_are_priced_again_for_another_cost_model() -> None:
    cache, cols = LoadTermCache(), columns([10, 100], [1, 3], queued=[1, 0])
    slow = CostModel(decode_fixed_ms=5.0)
    cache.terms(cols, CostModel())
    assert same(cache.terms(cols, slow), load_terms(cols, slow))
    # Calibrated per KV token, the step load is the running tokens': nothing of it is kept.
    calibrated = CostModel(decode_per_kv_token_ms=1e-5)
    terms = cache.terms(cols, calibrated)
    assert terms.decode_spread_ms is None and terms.queued_steps_ms is None and terms.any_queued


def test_terms_are_the_costs_operations() -> None:
    cm, cols = CostModel(), columns([10, 100, 0], [0, 3, 5], queued=[2, 0, 1])
    terms = load_terms(cols, cm)
    per_seq = cols.num_running * cm.decode_per_seq_ms
    step = cm.decode_fixed_ms + per_seq
    pool = np.maximum(cols.num_blocks, 1.0)
    in_use = 1.0 - cols.num_free_blocks / pool
    assert terms.step_ms.tobytes() == step.tobytes()
    assert terms.running_rows is not None and terms.running_rows.tolist() == [False, True, True]
    assert terms.queued_steps_ms is not None
    assert terms.queued_steps_ms.tobytes() == (cols.num_queued * step).tobytes()
    assert terms.decode_spread_ms is not None
    assert terms.decode_spread_ms.tobytes() == (per_seq - per_seq.min()).tobytes()
    assert terms.in_use.tobytes() == in_use.tobytes()
    assert terms.in_use_squared.tobytes() == (in_use * in_use).tobytes()
    assert load_terms(columns([1, 1], [2, 2]), cm).running_rows is None  # every worker runs
