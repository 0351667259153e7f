"""The parts of kvmesh's cost that a fleet's load columns alone decide, kept between decisions.

A pool's size and free blocks move with the workers' reports, not with each prompt, so many
decisions in a row see the same numbers; the running batches move with every request routed or
finished where the coordinator counts them, and only with the reports where the workers do. The
arrays made of such columns alone (a pool's share in use, a batch's decode step, ...) are priced
once and kept while the same numbers come back, each part keyed by its own columns, so a part
whose columns change on every decision does not take the others with it. The numbers are
compared, not the arrays: each decision's columns are new arrays (`FleetView.columns` gathers
them), and an array may be changed in place after a decision.

    num_blocks, num_free_blocks (bytes) ── the same as last time ──► kept `PoolTerms`
    num_running (bytes), cost model     ── the same as last time ──► kept `StepTerms`
    either changed                      ── priced again (the same operations: the same bits)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import WorkerColumns


class PoolTerms(NamedTuple):
    """Per row of a fleet, what `KvmeshPolicy._costs` prices from the pools' columns alone."""

    pool: np.ndarray
    """num_blocks, at least 1, as float64."""
    in_use: np.ndarray
    """The share of the pool in use: 1 - num_free_blocks / pool."""
    in_use_squared: np.ndarray
    """in_use * in_use."""


class StepTerms(NamedTuple):
    """Per row of a fleet, what `KvmeshPolicy._costs` prices from the running batches alone."""

    per_seq_ms: np.ndarray
    """The running batch's part of a decode step: num_running * decode_per_seq_ms."""
    step_ms: np.ndarray
    """One decode step of the running batch: decode_fixed_ms + per_seq_ms."""
    running_rows: np.ndarray | None
    """True where the worker runs a batch (None: every worker does)."""
    decode_spread_ms: np.ndarray | None
    """per_seq_ms above its least, where that is the batch's step load (None where the cost
    model is calibrated per KV token: the step load is then the running tokens')."""


def pool_terms(cols: WorkerColumns) -> PoolTerms:
    """The terms, priced as `KvmeshPolicy._costs` prices them (its operations, in its order)."""
    # (as floats once: an int64 operand is converted to float64 by each operation anyway; the
    # maximum with 1.0 gives float64 itself, the same numbers as converting after it)
    pool = np.maximum(cols.num_blocks, 1.0)
    in_use = 1.0 - cols.num_free_blocks / pool
    return PoolTerms(pool, in_use, in_use * in_use)


def step_terms(cols: WorkerColumns, cost_model: CostModel) -> StepTerms:
    """The terms, priced as `KvmeshPolicy._costs` prices them (its operations, in its order)."""
    cm, running = cost_model, cols.num_running
    per_seq_ms = running * cm.decode_per_seq_ms
    calibrated = cm.decode_per_kv_token_ms > 0
    return StepTerms(
        per_seq_ms,
        cm.decode_fixed_ms + per_seq_ms,
        None if np.count_nonzero(running) == len(running) else running != 0,
        None if calibrated else per_seq_ms - per_seq_ms[per_seq_ms.argmin()],
    )


class LoadTermCache:
    """The `PoolTerms` and `StepTerms` of the last fleet priced, each kept while its columns
    (and, for the steps, the cost model) are the same.

    Invariants: `_pool` is `pool_terms` of columns whose bytes are `_pool_key`; `_steps` is
    `step_terms` of a running column whose bytes are `_steps_key`, under `_cost_model` (held,
    so that its identity cannot pass to another model)."""

    def __init__(self) -> None:
        self._pool_key: tuple[bytes, bytes] | None = None
        self._pool: PoolTerms | None = None
        self._steps_key: bytes | None = None
        self._cost_model: CostModel | None = None
        self._steps: StepTerms | None = None

    def pool(self, cols: WorkerColumns) -> PoolTerms:
        key = (cols.num_blocks.tobytes(), cols.num_free_blocks.tobytes())
        if self._pool is None or self._pool_key != key:
            self._pool, self._pool_key = pool_terms(cols), key
        return self._pool

    def steps(self, cols: WorkerColumns, cost_model: CostModel) -> StepTerms:
        key = cols.num_running.tobytes()
        if self._steps is None or self._cost_model is not cost_model or self._steps_key != key:
            self._steps = step_terms(cols, cost_model)
            self._steps_key, self._cost_model = key, cost_model
        return self._steps

    def check_invariants(self) -> None:
        """Each kept part is what its key's columns price now (bit for bit)."""
        if self._pool is not None:
            assert self._pool_key is not None
            num_blocks, num_free = (np.frombuffer(b, dtype=np.int64) for b in self._pool_key)
            fresh = pool_terms(_columns(num_blocks=num_blocks, num_free_blocks=num_free))
            assert _same(self._pool, fresh), "the kept pool terms are not their columns'"
        if self._steps is not None:
            assert self._steps_key is not None and self._cost_model is not None
            running = np.frombuffer(self._steps_key, dtype=np.int64)
            fresh_steps = step_terms(_columns(num_running=running), self._cost_model)
            assert _same(self._steps, fresh_steps), "the kept step terms are not their columns'"


def _columns(**columns: np.ndarray) -> WorkerColumns:
    """A fleet with the given load columns (the others zeros)."""
    n = len(next(iter(columns.values())))
    zeros = np.zeros(n, dtype=np.int64)
    get = columns.get
    return WorkerColumns(
        tuple(WorkerId(str(i)) for i in range(n)),
        get("num_blocks", zeros),
        get("num_free_blocks", zeros),
        np.zeros(n),
        zeros,
        get("num_running", zeros),
        zeros,
        zeros,
    )


def _same(a: tuple[np.ndarray | None, ...], b: tuple[np.ndarray | None, ...]) -> bool:
    return all(
        x is y if x is None or y is None else x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True)
    )
