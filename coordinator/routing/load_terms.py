"""The parts of kvmesh's cost that a fleet's load columns alone decide, kept between decisions.

Capacity, free blocks, running and queued requests move with the workers' reports and this
coordinator's own routes, not with each prompt, so many decisions in a row see the same numbers.
The arrays made of them alone (a batch's decode step, a pool's share in use, ...) are priced once
and kept while the same numbers come back. The numbers are compared, not the arrays: each
decision's columns are new arrays (`FleetView.columns` gathers them), and an array may be changed
in place after a decision.

    columns (num_blocks, num_free_blocks, num_running, num_queued) as bytes
        ── the same as last time, same cost model ──► the kept `LoadTerms`
        ── else ──► priced again (the same operations as before: the same bits)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import WorkerColumns


class LoadTerms(NamedTuple):
    """Per row of a fleet, what `KvmeshPolicy._costs` prices from the load columns alone."""

    per_seq_ms: np.ndarray
    """The running batch's part of a decode step: num_running * decode_per_seq_ms."""
    step_ms: np.ndarray
    """One decode step of the running batch: decode_fixed_ms + per_seq_ms."""
    running_rows: np.ndarray | None
    """True where the worker runs a batch (None: every worker does)."""
    any_queued: bool
    """Some worker has a prefill queued."""
    queued_steps_ms: np.ndarray | None
    """num_queued * step_ms, where a step carries no KV term (None where it does, the cost
    model calibrated per KV token, or where nobody is queued)."""
    decode_spread_ms: np.ndarray | None
    """per_seq_ms above its least, where that is the batch's step load (None where the cost
    model is calibrated per KV token: then the step load is the running tokens')."""
    pool: np.ndarray
    """num_blocks, at least 1, as float64."""
    in_use: np.ndarray
    """The share of the pool in use: 1 - num_free_blocks / pool."""
    in_use_squared: np.ndarray
    """in_use * in_use."""


def load_terms(cols: WorkerColumns, cost_model: CostModel) -> LoadTerms:
    """The terms, priced as `KvmeshPolicy._costs` prices them (its operations, in its order)."""
    cm, running = cost_model, cols.num_running
    per_seq_ms = running * cm.decode_per_seq_ms
    step_ms = cm.decode_fixed_ms + per_seq_ms
    calibrated = cm.decode_per_kv_token_ms > 0
    any_queued = bool(np.count_nonzero(cols.num_queued))
    # (as floats once: an int64 operand is converted to float64 by each operation anyway; the
    # maximum with 1.0 gives float64 itself, the same numbers as converting after it)
    pool = np.maximum(cols.num_blocks, 1.0)
    in_use = 1.0 - cols.num_free_blocks / pool
    return LoadTerms(
        per_seq_ms,
        step_ms,
        None if np.count_nonzero(running) == len(running) else running != 0,
        any_queued,
        cols.num_queued * step_ms if any_queued and not calibrated else None,
        None if calibrated else per_seq_ms - per_seq_ms[per_seq_ms.argmin()],
        pool,
        in_use,
        in_use * in_use,
    )


class LoadTermCache:
    """The `LoadTerms` of the last fleet priced, kept while its load columns and the cost model
    are the same.

    Invariant: `_terms` is `load_terms` of columns whose bytes are `_key`, under `_cost_model`
    (held, so its identity cannot pass to another model)."""

    def __init__(self) -> None:
        self._key: tuple[bytes, bytes, bytes, bytes] | None = None
        self._cost_model: CostModel | None = None
        self._terms: LoadTerms | None = None

    def terms(self, cols: WorkerColumns, cost_model: CostModel) -> LoadTerms:
        key = (
            cols.num_blocks.tobytes(),
            cols.num_free_blocks.tobytes(),
            cols.num_running.tobytes(),
            cols.num_queued.tobytes(),
        )
        if self._terms is None or self._cost_model is not cost_model or self._key != key:
            self._terms = load_terms(cols, cost_model)
            self._key, self._cost_model = key, cost_model
        return self._terms
