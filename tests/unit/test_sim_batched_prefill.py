"""The simulator's batched prefill: waiting requests share one prefill step, as kvmesh's engine
admits every waiting request that fits its token budget into one step."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.client.workloads import WorkloadRequest
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests

ENGINE = SimCostModel(decodes_ride_prefill=False, host_step_fixed_ms=0.6, host_step_per_seq_ms=0.04)
BATCHED = SimCostModel.from_mapping({"prefill_batch_tokens": 8192}, ENGINE)


def test_one_chunk_costs_what_a_step_of_its_own_does() -> None:
    for new, done in ((1, 0), (256, 8192), (8192, 0)):
        alone = ENGINE.chunk_step_ms(new, done, 0, 0)
        assert ENGINE.prefill_batch_step_ms([(new, done)]) == pytest.approx(alone)


def test_a_batched_step_pays_the_forwards_fixed_part_and_host_time_once() -> None:
    chunks = [(256, 8192), (256, 8192), (300, 0)]
    separate = sum(ENGINE.chunk_step_ms(new, done, 0, 0) for new, done in chunks)
    shared = 2 * (ENGINE.prefill_fixed_ms + ENGINE.host_step_fixed_ms)
    assert ENGINE.prefill_batch_step_ms(chunks) == pytest.approx(separate - shared)


def test_a_batched_step_needs_chunks_with_new_tokens() -> None:
    with pytest.raises(ValueError, match="at least one chunk"):
        ENGINE.prefill_batch_step_ms([])
    with pytest.raises(ValueError, match=">= 1 new token"):
        ENGINE.prefill_batch_step_ms([(0, 100)])


def test_batching_needs_prefill_steps_without_decodes() -> None:
    with pytest.raises(ValueError, match="needs decodes_ride_prefill false"):
        SimCostModel(prefill_batch_tokens=8192)
    parsed = SimCostModel.from_mapping({"prefill_batch_tokens": "4096"}, ENGINE)
    assert parsed.prefill_batch_tokens == 4096


def _first_tokens(cost: SimCostModel, requests: list[WorkloadRequest]) -> list[float]:
    """Each request's first token on the worker's clock (arrival + TTFT; no service latency)."""
    config = SimConfig(1, 65536, 16, cost=cost)
    simulation = ClusterSimulation(config, "round_robin", prepare_requests(requests, 16))
    simulation.run()
    for worker in simulation.workers:
        worker.check_invariants()
    return [r.arrival_ms + t[0] for r, t in zip(requests, simulation.request_times(), strict=True)]


def _a_long_prefill_then_three_short_ones() -> list[WorkloadRequest]:
    """A's 4K prefill is running when B, C and D (300 new tokens each) arrive."""
    long = WorkloadRequest(0.0, np.full(4096, 1, dtype=np.uint32), 4)
    short = [WorkloadRequest(1.0 + i, np.full(300, 2 + i, dtype=np.uint32), 4) for i in range(3)]
    return [long, *short]


def test_requests_waiting_together_share_one_prefill_step() -> None:
    a, b, c, d = _first_tokens(BATCHED, _a_long_prefill_then_three_short_ones())
    step = BATCHED.prefill_batch_step_ms([(300, 0)] * 3)
    assert b == c == d == pytest.approx(a + step)


def test_the_budget_stops_at_the_first_request_that_does_not_fit() -> None:
    tight = SimCostModel.from_mapping({"prefill_batch_tokens": 600}, ENGINE)
    a, b, c, d = _first_tokens(tight, _a_long_prefill_then_three_short_ones())
    assert b == c == pytest.approx(a + tight.prefill_batch_step_ms([(300, 0)] * 2))
    assert d > c  # its own step, after the pair's


def test_without_a_budget_each_prefill_has_a_step_of_its_own() -> None:
    a, b, c, d = _first_tokens(ENGINE, _a_long_prefill_then_three_short_ones())
    own = ENGINE.chunk_step_ms(300, 0, 0, 0)
    assert b == pytest.approx(a + own)
    assert c == pytest.approx(b + own) and d == pytest.approx(c + own)
