"""Decode in steps: closed-form step timing, chunk steps that carry decodes, TPOT and goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.client.workloads import WorkloadRequest
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.decode_run import DecodeRun
from kvmesh.coordinator.sim.report import PolicyResult, Slo
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests

COST = SimCostModel()


def _explicit_steps(run: DecodeRun, n: int) -> list[float]:
    """Step boundaries, one step at a time: the reference the closed form must match."""
    t, out = run.start_ms, []
    for j in range(n):
        t += run.step_ms + run.per_token_ms * (run.context_tokens + run.batch_size * j)
        out.append(t)
    return out


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_run_matches_step_by_step_timing(batch: int) -> None:
    run = DecodeRun(100.0, COST.decode_step_ms(batch, 0), 9.2e-5, 5000 * batch, batch)
    ends = _explicit_steps(run, 300)
    assert [run.end_of_step_ms(n) for n in range(1, 301)] == pytest.approx(ends, rel=1e-12)
    for n, end in enumerate(ends, 1):
        assert run.steps_done_by(end) == n  # a step ending now is done
        assert run.steps_done_by(end - 1e-3) == n - 1
        assert run.boundary_at_or_after(end - 1e-3) == pytest.approx(end)
    assert run.boundary_at_or_after(50.0) == 100.0


def test_decode_steps_slow_down_as_the_kv_grows() -> None:
    run = DecodeRun(0.0, COST.decode_step_ms(32, 0), 9.2e-5, 32 * 4000, 32)
    first, last = run.duration_ms(1), run.duration_ms(1000) - run.duration_ms(999)
    assert last - first == pytest.approx(999 * 32 * 9.2e-5)


def test_a_run_without_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="decode steps must take time"):
        DecodeRun(0.0, 0.0, 0.0, 0, 1)


def _run(requests: list[WorkloadRequest], **kw: object) -> PolicyResult:
    config = SimConfig(1, 65536, 16, **kw)  # type: ignore[arg-type]
    return ClusterSimulation(config, "round_robin", prepare_requests(requests, 16)).run()


def _request(at_ms: float, prompt_len: int, output_len: int, token: int) -> WorkloadRequest:
    return WorkloadRequest(at_ms, np.full(prompt_len, token, dtype=np.uint32), output_len)


def test_one_request_pays_its_prefill_then_one_step_per_token_over_its_growing_kv() -> None:
    result = _run([_request(0.0, 64, 5, 1)])
    prefill = COST.prefill_ms(64, 0)
    decode = sum(COST.decode_step_ms(1, 64 + 1 + j) for j in range(4))
    assert result.ttft_ms == (pytest.approx(prefill),)
    assert result.e2e_ms == (pytest.approx(prefill + decode),)
    assert result.tpot_ms == (pytest.approx(decode / 4),)


def test_a_prefill_arriving_mid_decode_waits_for_the_boundary_and_slows_the_batch() -> None:
    alone = _run([_request(0.0, 64, 200, 1)])
    a_first_ms = COST.prefill_ms(64, 0)
    arrival = a_first_ms + 2.5 * COST.decode_step_ms(1, 66)  # mid third step
    both = _run([_request(0.0, 64, 200, 1), _request(arrival, 4096, 2, 2)])
    boundary = a_first_ms + sum(COST.decode_step_ms(1, 65 + j) for j in range(3))
    chunk = COST.prefill_ms(4096, 0) + COST.decode_step_ms(1, 65 + 3)
    assert both.ttft_ms[1] == pytest.approx(boundary + chunk - arrival)
    # The chunk step gave A one token at the price of a 4K prefill: A's TPOT rises by about
    # (chunk - one decode step) / 199, minus the one shared step B's short decode adds.
    slower = both.tpot_ms[0] - alone.tpot_ms[0]
    assert slower > (COST.prefill_ms(4096, 0) - 0.1) / 199


def test_goodput_counts_only_requests_within_both_bounds() -> None:
    slo = Slo(ttft_ms=1000.0, tpot_ms=50.0)
    met = slo.met(np.array([10.0, 10.0, 2000.0, 10.0]), np.array([10.0, 60.0, 10.0, math.nan]))
    assert met.tolist() == [True, False, False, True]
    requests = [_request(0.0, 64, 5, 1), _request(0.0, 64, 1, 2)]
    assert _run(requests).slo_attainment == 1.0
    tight = _run(requests, slo=Slo(ttft_ms=1000.0, tpot_ms=1.0))
    assert tight.slo_attainment == 0.5  # the one-token request
    assert tight.goodput_rps == pytest.approx(0.5 * tight.throughput_rps)
    with pytest.raises(ValueError, match="SLO bounds must be > 0"):
        Slo(ttft_ms=0.0)
