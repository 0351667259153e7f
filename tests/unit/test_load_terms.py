"""The load-only terms of kvmesh's cost, kept between decisions while their columns stay."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_terms import LoadTermCache, pool_terms, step_terms
from kvmesh.coordinator.routing.policy import WorkerColumns


def columns(free: list[int], running: list[int], num_blocks: int = 100) -> WorkerColumns:
    n = len(free)
    zeros = np.zeros(n, dtype=np.int64)
    return WorkerColumns(
        tuple(WorkerId(f"w{i}") for i in range(n)),
        np.full(n, num_blocks, dtype=np.int64),
        np.array(free),
        np.zeros(n),
        zeros,
        np.array(running),
        zeros,
        zeros,
    )


def same(a: NamedTuple, b: NamedTuple) -> bool:
    """Field by field, arrays bit for bit."""
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif x.tobytes() != y.tobytes():
            return False
    return True


def test_terms_are_kept_while_the_same_numbers_come_in_new_arrays() -> None:
    cache, cm = LoadTermCache(), CostModel()
    pools, steps = (
        cache.pool(columns([10, 100], [0, 3])),
        cache.steps(columns([10, 100], [0, 3]), cm),
    )
    assert cache.pool(columns([10, 100], [0, 3])) is pools
    assert cache.steps(columns([10, 100], [0, 3]), cm) is steps
    assert same(pools, pool_terms(columns([10, 100], [0, 3])))
    assert same(steps, step_terms(columns([10, 100], [0, 3]), cm))


def test_each_part_is_priced_again_when_its_columns_change_even_in_place() -> None:
    cache, cm = LoadTermCache(), CostModel()
    cols = columns([10, 100], [0, 3])
    pools, steps = cache.pool(cols), cache.steps(cols, cm)
    cache.check_invariants()
    cols.num_free_blocks[0] = 50  # the same array, other numbers: the pools' part only
    assert cache.steps(cols, cm) is steps
    again = cache.pool(cols)
    assert again is not pools and same(again, pool_terms(cols))
    cols.num_running[0] = 2  # the steps' part only
    assert cache.pool(cols) is again
    assert same(cache.steps(cols, cm), step_terms(cols, cm))
    assert cache.steps(cols, cm).running_rows is None  # every worker runs now
    other = columns([50, 100], [2, 3], num_blocks=80)
    assert same(cache.pool(other), pool_terms(other))
    cache.check_invariants()


def test_steps_are_priced_again_for_another_cost_model() -> None:
    cache, cols = LoadTermCache(), columns([10, 100], [1, 3])
    slow = CostModel(decode_fixed_ms=5.0)
    cache.steps(cols, CostModel())
    assert same(cache.steps(cols, slow), step_terms(cols, slow))
    # Calibrated per KV token, the step load is the running tokens': no spread is kept.
    assert cache.steps(cols, CostModel(decode_per_kv_token_ms=1e-5)).decode_spread_ms is None
    cache.check_invariants()


def test_terms_are_the_costs_operations() -> None:
    cm, cols = CostModel(), columns([10, 100, 0], [0, 3, 5])
    pools, steps = pool_terms(cols), step_terms(cols, cm)
    per_seq = cols.num_running * cm.decode_per_seq_ms
    pool = np.maximum(cols.num_blocks, 1.0)
    in_use = 1.0 - cols.num_free_blocks / pool
    assert steps.step_ms.tobytes() == (cm.decode_fixed_ms + per_seq).tobytes()
    assert steps.running_rows is not None and steps.running_rows.tolist() == [False, True, True]
    assert steps.decode_spread_ms is not None
    assert steps.decode_spread_ms.tobytes() == (per_seq - per_seq.min()).tobytes()
    assert pools.in_use.tobytes() == in_use.tobytes()
    assert pools.in_use_squared.tobytes() == (in_use * in_use).tobytes()


def test_the_check_catches_a_kept_part_that_is_not_its_columns() -> None:
    cache = LoadTermCache()
    cache.pool(columns([10, 100], [0, 3])).in_use[0] = 0.5  # (kept terms are never written)
    with pytest.raises(AssertionError):
        cache.check_invariants()
