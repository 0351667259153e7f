"""The engine's queued decode steps on a GPU, through the decode graphs: the tokens of the engine
that reads each step first, in bf16 (few-row matmuls) and float32."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.model.weights import random_weights
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BS = 16


def workers(dtype: torch.dtype) -> tuple[Worker, Worker]:
    """(pipelined, reading each step) workers on the same weights, each with its own cache."""
    config = small_config()
    weights = random_weights(config, seed=0, device="cuda", dtype=dtype)
    out = []
    for pipelined in (True, False):
        runner = ModelRunner(config, 512, BS, device="cuda", dtype=dtype, weights=weights)
        assert runner.cuda_graphs
        sched = SchedulerConfig(BS, 16, 4096)
        out.append(Worker("w", runner, config.fingerprint(), sched, pipelined_decode=pipelined))
    return out[0], out[1]


def requests(stop: int | None = None, *, sampled: bool = False) -> list[WorkerRequest]:
    """Nine requests; `sampled`: every other one draws (temperature, top_k / top_p, a seed)."""
    rng = random.Random(5)
    out = []
    for i, max_tokens in enumerate((3, 19, 8, 12, 30, 5, 16, 9, 24)):
        ids = tuple(rng.randrange(3, 300) for _ in range(rng.randrange(20, 300)))
        stops = (stop,) if stop is not None and i == 4 else ()
        config = SamplingConfig(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops)
        if sampled and i % 2:
            config = SamplingConfig(
                max_tokens=max_tokens,
                ignore_eos=True,
                temperature=0.8,
                top_k=40 * (i % 4 == 1),
                top_p=0.9,
                seed=i,
            )
        out.append(WorkerRequest(f"r{i}", ids, config))
    return out


def serve(w: Worker, reqs: list[WorkerRequest], abort_at: int = -1) -> dict[str, list[int]]:
    for r in reqs:
        w.add_request(r)
    out: dict[str, list[int]] = defaultdict(list)
    num_steps = 0
    while w.has_work:
        if num_steps == abort_at:
            w.abort("r1")
        for o in w.step():
            out[o.request_id] += o.new_token_ids
        num_steps += 1
        w.check_invariants()
    assert w.pool.num_free == w.pool.num_blocks
    return dict(out)


@pytest.mark.parametrize(
    ("dtype", "sampled"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_queued_steps_give_the_same_tokens_through_the_graphs(
    dtype: torch.dtype, sampled: bool
) -> None:
    """Greedy, or half the requests drawing on the device (the same draws as the sampler's)."""
    pipelined, reading = workers(dtype)
    want = serve(reading, requests(sampled=sampled))
    got = serve(pipelined, requests(sampled=sampled))
    assert got == want
    counters = pipelined.info().counters
    assert counters.num_queued_decode_steps >= 20 and counters.num_decode_graph_replays >= 20
    assert counters.num_dropped_decode_rows == 0
    assert reading.info().counters.num_queued_decode_steps == 0


def test_stops_and_aborts_while_queued_drop_their_rows_only() -> None:
    pipelined, reading = workers(torch.float32)
    stop = serve(reading, requests())["r4"][6]
    want = serve(reading, requests(stop), abort_at=5)
    got = serve(pipelined, requests(stop), abort_at=5)
    # Each step() returns one step's outputs in both engines, so r1, aborted between two,
    # got the same tokens from each (the pipelined one's queued row for it is dropped).
    assert got == want
    assert got["r4"][-1] == stop and len(got["r1"]) < 19
    assert pipelined.info().counters.num_dropped_decode_rows >= 1
