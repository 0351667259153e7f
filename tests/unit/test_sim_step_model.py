"""The simulator's step model: the engine's host time per step and the tokens' delivery cost."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvmesh.client.workloads import WorkloadRequest
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.delivery import StreamDelivery
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests

HOST = SimCostModel(host_step_fixed_ms=0.6, host_step_per_seq_ms=0.04)
DELIVERY = SimCostModel(delivery_fixed_ms=0.5, delivery_per_stream_ms=0.8)


def test_host_time_is_a_fixed_part_plus_a_part_per_sequence() -> None:
    assert HOST.host_step_ms(0) == 0.0
    assert HOST.host_step_ms(1) == pytest.approx(0.64)
    assert HOST.host_step_ms(32) == pytest.approx(0.6 + 32 * 0.04)


def test_a_decode_step_carries_its_host_time() -> None:
    gpu = SimCostModel()
    for batch, context in ((1, 2048), (32, 65536)):
        step = HOST.decode_step_ms(batch, context)
        assert step == pytest.approx(gpu.decode_step_ms(batch, context) + HOST.host_step_ms(batch))
    assert HOST.decode_step_ms(0, 0) == 0.0  # no batch, no step


def test_a_chunk_step_pays_host_time_once_for_every_sequence_in_it() -> None:
    gpu = SimCostModel()
    alone = HOST.chunk_step_ms(512, 7680, 0, 0)
    assert alone == pytest.approx(gpu.prefill_ms(512, 7680) + HOST.host_step_ms(1))
    carrying = HOST.chunk_step_ms(512, 7680, 3, 6000)
    expected = gpu.prefill_ms(512, 7680) + gpu.decode_step_ms(3, 6000) + HOST.host_step_ms(4)
    assert carrying == pytest.approx(expected)


def test_delivery_grows_with_the_streams_in_flight() -> None:
    assert DELIVERY.delivery_ms(0) == 0.0
    assert DELIVERY.delivery_ms(1) == pytest.approx(1.3)
    assert DELIVERY.delivery_ms(2.5) == pytest.approx(0.5 + 2.5 * 0.8)


def test_zero_terms_leave_every_step_as_it_was() -> None:
    plain = SimCostModel()
    zeros = SimCostModel(
        host_step_fixed_ms=0.0,
        host_step_per_seq_ms=0.0,
        delivery_fixed_ms=0.0,
        delivery_per_stream_ms=0.0,
    )
    for batch, context in ((1, 100), (7, 12345), (64, 300000)):
        # Bit for bit: the existing tables must reproduce digit for digit.
        assert zeros.decode_step_ms(batch, context) == (
            plain.decode_fixed_ms
            + batch * plain.decode_per_seq_ms
            + context * plain.decode_per_context_token_ms
        )
        prefill = plain.prefill_ms(4096, 100)
        assert zeros.chunk_step_ms(4096, 100, batch, context) == prefill + plain.decode_step_ms(
            batch, context
        )
    assert zeros.router_cost_model() == plain.router_cost_model()


def test_the_router_prices_steps_with_their_host_time() -> None:
    plain, router = SimCostModel().router_cost_model(), HOST.router_cost_model()
    assert router.decode_fixed_ms == pytest.approx(plain.decode_fixed_ms + 0.6)
    assert router.decode_per_seq_ms == pytest.approx(plain.decode_per_seq_ms + 0.04)


def test_negative_terms_are_refused() -> None:
    with pytest.raises(ValueError, match="host_step_per_seq_ms must be >= 0"):
        SimCostModel(host_step_per_seq_ms=-0.1)
    with pytest.raises(ValueError, match="delivery_per_stream_ms must be >= 0"):
        SimCostModel.from_mapping({"delivery_per_stream_ms": -1})


def test_a_lone_stream_gets_each_token_one_delivery_later() -> None:
    delivery = StreamDelivery(DELIVERY, 1)
    assert delivery.open(0, 0, 100.0) == pytest.approx(101.3)
    delivery.check_invariants()
    # The worker's gaps (10 ms a token) are longer than delivery's 1.3 ms: it keeps up.
    first, last = delivery.close(0, 170.0, 8)
    assert (first, last) == pytest.approx((101.3, 171.3))
    delivery.check_invariants()
    assert delivery.num_streams == [0]


def test_streams_sharing_a_coordinator_are_paced_by_its_delivery() -> None:
    """32 streams, the worker making a token for each every 11.7 ms, the coordinator needing
    0.78 ms per token: each stream gets a token every 32 x 0.78 = 25 ms, not 11.7."""
    cost = SimCostModel(delivery_per_stream_ms=0.78)
    delivery = StreamDelivery(cost, 1)
    firsts = [delivery.open(i, 0, 0.0) for i in range(32)]
    assert firsts[-1] == pytest.approx(32 * 0.78)
    num_tokens = 64
    last_worker_ms = (num_tokens - 1) * 11.7
    for i in range(32):
        first, last = delivery.close(i, last_worker_ms, num_tokens)
        # The mean over the stream's life: all 32 were in flight the whole time.
        assert (last - first) / (num_tokens - 1) == pytest.approx(32 * 0.78)
        delivery.check_invariants()


def test_streams_count_per_coordinator() -> None:
    delivery = StreamDelivery(DELIVERY, 2)
    delivery.open(0, 0, 0.0)
    assert delivery.open(1, 1, 0.0) == pytest.approx(1.3)  # alone on its coordinator
    assert delivery.open(2, 0, 0.0) == pytest.approx(0.5 + 2 * 0.8)
    assert delivery.num_streams == [2, 1]
    delivery.check_invariants()


def test_the_mean_streams_in_flight_price_the_rest_of_a_stream() -> None:
    cost = SimCostModel(delivery_per_stream_ms=1.0)
    delivery = StreamDelivery(cost, 1)
    delivery.open(0, 0, 0.0)
    delivery.open(1, 0, 50.0)  # a second stream for the last half of the first one's life
    delivery.close(1, 100.0, 2)
    first, last = delivery.close(0, 100.0, 101)
    # 1.5 streams on average over [0, 100]: 1.5 ms a token, slower than the worker's 1 ms.
    assert first == pytest.approx(1.0)
    assert last == pytest.approx(1.0 + 100 * 1.5)


def test_a_stream_opens_once() -> None:
    delivery = StreamDelivery(DELIVERY, 1)
    delivery.open(0, 0, 0.0)
    with pytest.raises(ValueError, match="already open"):
        delivery.open(0, 0, 1.0)


def _times(cost: SimCostModel, requests: list[WorkloadRequest]) -> list[tuple[float, ...]]:
    config = SimConfig(1, 65536, 16, cost=cost)
    simulation = ClusterSimulation(config, "round_robin", prepare_requests(requests, 16))
    simulation.run()
    return simulation.request_times()


def test_host_time_delays_the_next_step_and_delivery_only_the_client() -> None:
    """One request of 64 tokens: host time stretches every step (TPOT grows by host_step_ms(1)),
    delivery shifts the client's tokens by delivery_ms(1) and leaves the pace alone."""
    request = [WorkloadRequest(0.0, np.arange(256, dtype=np.uint32), 64)]
    ((ttft, tpot, e2e),) = _times(SimCostModel(), request)
    ((h_ttft, h_tpot, h_e2e),) = _times(HOST, request)
    ((d_ttft, d_tpot, d_e2e),) = _times(DELIVERY, request)
    assert h_ttft == pytest.approx(ttft + HOST.host_step_ms(1))
    assert h_tpot == pytest.approx(tpot + HOST.host_step_ms(1))
    assert d_ttft == pytest.approx(ttft + DELIVERY.delivery_ms(1))
    assert d_tpot == pytest.approx(tpot)
    assert d_e2e == pytest.approx(e2e + DELIVERY.delivery_ms(1))
    assert not math.isnan(h_e2e)


def test_delivery_takes_no_worker_time() -> None:
    requests = [WorkloadRequest(i * 5.0, np.full(300, i, dtype=np.uint32), 32) for i in range(24)]
    slow = SimCostModel(delivery_per_stream_ms=2.0)
    config = SimConfig(2, 65536, 16)
    plain = ClusterSimulation(config, "least_loaded", prepare_requests(requests, 16))
    late = ClusterSimulation(
        SimConfig(2, 65536, 16, cost=slow), "least_loaded", prepare_requests(requests, 16)
    )
    a, b = plain.run(), late.run()
    assert a.requests_per_worker == b.requests_per_worker
    assert [w.busy_ms for w in plain.workers] == [w.busy_ms for w in late.workers]
    for (ttft, tpot, _), (ttft2, tpot2, _) in zip(
        plain.request_times(), late.request_times(), strict=True
    ):
        assert ttft2 > ttft and tpot2 >= tpot
    late.delivery.check_invariants()
    assert late.delivery.num_streams == [0]


def test_the_fitted_h100_cost_model_loads() -> None:
    path = Path(__file__).parents[2] / "docs" / "data" / "sim_cost_h100_service_path.json"
    values = json.loads(path.read_text())
    cost = SimCostModel.from_json(path)
    assert cost.host_step_fixed_ms == values["host_step_fixed_ms"] > 0
    assert cost.delivery_per_stream_ms == values["delivery_per_stream_ms"] > 0


def test_without_riding_a_prefill_step_is_the_prefills_alone() -> None:
    alone = SimCostModel(decodes_ride_prefill=False)
    assert alone.chunk_step_ms(512, 0, 8, 16000) == alone.chunk_step_ms(512, 0, 0, 0)
    assert alone.chunk_step_ms(512, 0, 0, 0) == SimCostModel().prefill_ms(512, 0)


@pytest.mark.parametrize(
    ("raw", "expected"), [(False, False), ("true", True), ("0", False), (1, True)]
)
def test_the_ride_flag_reads_from_json_and_the_command_line(raw: object, expected: bool) -> None:
    cost = SimCostModel.from_mapping({"decodes_ride_prefill": raw})  # type: ignore[dict-item]
    assert cost.decodes_ride_prefill is expected


def test_the_ride_flag_refuses_anything_else() -> None:
    with pytest.raises(ValueError, match="must be true or false"):
        SimCostModel.from_mapping({"decodes_ride_prefill": "maybe"})


def test_decodes_wait_through_queued_prefills_that_do_not_carry_them() -> None:
    """A has one token left to make when three 8K prefills queue up. Riding, the first prefill's
    step makes A's token; not riding (prefill first), A waits for all three."""
    a_first_ms = SimCostModel().prefill_ms(64, 0)
    requests = [WorkloadRequest(0.0, np.full(64, 1, dtype=np.uint32), 3)] + [
        WorkloadRequest(a_first_ms + 0.5, np.full(8192, 2 + i, dtype=np.uint32), 2)
        for i in range(3)
    ]
    riding, waiting = SimCostModel(), SimCostModel(decodes_ride_prefill=False)
    ride_times, wait_times = _times(riding, requests), _times(waiting, requests)
    prefill_ms = riding.prefill_ms(8192, 0)
    ride_e2e, wait_e2e = ride_times[0][2], wait_times[0][2]
    assert ride_e2e < a_first_ms + 2 * riding.decode_step_ms(1, 70) + prefill_ms
    assert wait_e2e > a_first_ms + 3 * prefill_ms
    # The queued prefills' first tokens come sooner without A's decode in their steps.
    for ride, wait in zip(ride_times[1:], wait_times[1:], strict=True):
        assert wait[0] < ride[0]


def test_a_streams_end_lengthens_its_last_gap_and_takes_no_worker_time() -> None:
    """stream_end_ms: the request's end-to-end time grows by it, its TPOT by it / (tokens - 1),
    its TTFT and the worker's busy time not at all."""
    request = [WorkloadRequest(0.0, np.arange(256, dtype=np.uint32), 8)]
    ((ttft, tpot, e2e),) = _times(SimCostModel(), request)
    ((e_ttft, e_tpot, e_e2e),) = _times(SimCostModel(stream_end_ms=3.5), request)
    assert e_ttft == pytest.approx(ttft)
    assert e_tpot == pytest.approx(tpot + 3.5 / 7)
    assert e_e2e == pytest.approx(e2e + 3.5)


BETWEEN = SimCostModel(host_step_per_seq_ms=0.04, host_between_steps_per_seq_ms=0.4)


def test_time_between_steps_is_charged_per_sequence_the_step_carried() -> None:
    alone = SimCostModel(host_step_per_seq_ms=0.04)
    for batch, context in ((1, 2048), (8, 65536)):
        assert BETWEEN.decode_step_ms(batch, context) == pytest.approx(
            alone.decode_step_ms(batch, context) + 0.4 * batch
        )
    assert BETWEEN.chunk_step_ms(512, 7680, 0, 0) == pytest.approx(
        alone.chunk_step_ms(512, 7680, 0, 0) + 0.4
    )
    chunks = [(8448, 0), (256, 8192), (256, 8192)]
    assert BETWEEN.prefill_batch_step_ms(chunks) == pytest.approx(
        alone.prefill_batch_step_ms(chunks) + 3 * 0.4
    )
    assert BETWEEN.host_step_ms(0) == 0.0  # no step, nothing between steps


def test_time_between_steps_is_off_by_default_and_leaves_the_router_alone() -> None:
    plain = SimCostModel(host_step_fixed_ms=0.6, host_step_per_seq_ms=0.04)
    explicit = replace(plain, host_between_steps_per_seq_ms=0.0)
    for batch, context in ((1, 100), (7, 12345)):
        # Bit for bit: the tables made without the term must reproduce digit for digit.
        assert explicit.decode_step_ms(batch, context) == plain.decode_step_ms(batch, context)
        assert explicit.chunk_step_ms(4096, 100, 0, 0) == plain.chunk_step_ms(4096, 100, 0, 0)
    assert SimCostModel().host_between_steps_per_seq_ms == 0.0
    assert (
        BETWEEN.router_cost_model()
        == replace(BETWEEN, host_between_steps_per_seq_ms=0.0).router_cost_model()
    )


def test_time_between_steps_stretches_every_token_of_a_lone_request() -> None:
    """One request of 64 tokens on an idle worker: each of its steps carries one sequence, so
    its first token and every later one come 0.4 ms later a step."""
    request = [WorkloadRequest(0.0, np.arange(256, dtype=np.uint32), 64)]
    base = replace(BETWEEN, host_between_steps_per_seq_ms=0.0)
    ((ttft, tpot, _),) = _times(base, request)
    ((b_ttft, b_tpot, _),) = _times(BETWEEN, request)
    assert b_ttft == pytest.approx(ttft + 0.4)
    assert b_tpot == pytest.approx(tpot + 0.4)


def test_a_loaded_worker_decodes_in_fewer_larger_steps_with_time_between_steps() -> None:
    """Prefill-first: a longer step lets more prompts arrive during it, so the running
    sequences wait through more prefills and each decode step carries more of them."""
    arrivals_ms = np.cumsum(np.random.default_rng(0).exponential(50.0, 60))  # ~90 % prefill
    requests = [
        WorkloadRequest(float(t), np.full(2048, i, dtype=np.uint32), 16)
        for i, t in enumerate(arrivals_ms)
    ]
    quick = SimCostModel(decodes_ride_prefill=False, chunk_tokens=131072)
    slow = replace(quick, host_between_steps_per_seq_ms=1.0)
    steps = []
    for cost in (quick, slow):
        config = SimConfig(1, 1 << 20, 16, cost=cost)
        simulation = ClusterSimulation(config, "round_robin", prepare_requests(requests, 16))
        simulation.run()
        steps.append(simulation.workers[0].steps)
    assert steps[1] < steps[0]
