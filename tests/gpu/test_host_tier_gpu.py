"""Host-tier promotion on the GPU: the layer-by-layer load writes exactly the blocks one copy
would, and a prompt served from the host tier gives the tokens and logits of a cold run."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.kv import layer_load
from kvmesh.workers.kv.copy_engine import CopyEngine
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.kv.layer_gates import LayerGates
from kvmesh.workers.kv.layer_load import MAX_COPY_RUNS, LayerLoad
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.model.weights import random_weights
from tests.gpu.small_model import small_config
from tests.gpu.triton_variants import compiled_variants

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BS = 16
PREFIX = [(i * 5) % 250 + 3 for i in range(96)]  # 6 blocks


def test_a_layer_load_writes_what_one_copy_writes() -> None:
    cache = torch.randn((4, 2, 64, BS, 2, 64), device="cuda", dtype=torch.bfloat16)
    expected = cache.clone()
    host = torch.randn((40, 4, 2, BS, 2, 64), dtype=torch.bfloat16).pin_memory()
    slots, blocks = [3, 17, 4, 39, 0], [60, 2, 33, 7, 8]
    expected[:, :, blocks] = host[slots].to("cuda").permute(1, 2, 0, 3, 4, 5)
    load = LayerLoad(host, slots, cache, blocks, torch.cuda.Stream())
    load.wait_all()
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


def test_layer_loads_of_any_count_run_one_compiled_kernel() -> None:
    num_layers = 17  # layers 1 and 16: values Triton would specialise on
    cache = torch.zeros((num_layers, 2, 40, BS, 2, 64), device="cuda", dtype=torch.bfloat16)
    host = torch.randn((48, num_layers, 2, BS, 2, 64), dtype=torch.bfloat16).pin_memory()
    LayerLoad(host, [0], cache, [0], torch.cuda.Stream()).done.synchronize()
    before = compiled_variants(layer_load._load_layer_kernel)
    for n in (16, 5, 1, 32):
        slots, blocks = list(range(47, 47 - n, -1)), [(1 + 3 * i) % 40 for i in range(n)]
        LayerLoad(host, slots, cache, blocks, torch.cuda.Stream()).done.synchronize()
        expected = host[slots].to("cuda").permute(1, 2, 0, 3, 4, 5)
        assert torch.equal(cache[:, :, blocks], expected), n
    if before is not None:
        assert compiled_variants(layer_load._load_layer_kernel) == before


@pytest.mark.parametrize(
    "slots",
    [
        [17, 3, 39, 4, 18, 5, 0, 2],  # 4 runs, out of order: the copy engine
        list(range(0, 2 * (MAX_COPY_RUNS + 1), 2)),  # a run a slot, too many: the kernel
    ],
)
@pytest.mark.parametrize(
    "two_streams, gated", [(False, False), (True, False), (True, True)], ids=["one", "two", "gated"]
)
def test_a_copy_engine_load_writes_what_one_copy_writes(
    slots: list[int], two_streams: bool, gated: bool
) -> None:
    engine = CopyEngine.find()
    if engine is None:
        pytest.skip("no CUDA runtime library mapped in this process")
    if gated and not LayerGates.usable():
        pytest.skip("this torch makes no external events")
    num_layers = 5  # each staging layer reused, on either stream
    cache = torch.randn((num_layers, 2, 64, BS, 2, 64), device="cuda", dtype=torch.bfloat16)
    expected = cache.clone()
    num_slots = max(40, max(slots) + 1)
    host = torch.randn((num_slots, num_layers, 2, BS, 2, 64), dtype=torch.bfloat16).pin_memory()
    blocks = [(7 * i + 5) % 64 for i in range(len(slots))]
    expected[:, :, blocks] = host[slots].to("cuda").permute(1, 2, 0, 3, 4, 5)
    load = LayerLoad(
        host, slots, cache, blocks, torch.cuda.Stream(), copy_engine=engine,
        gates=LayerGates(num_layers, cache.device) if gated else None,
        second_stream=torch.cuda.Stream() if two_streams else None,
    )  # fmt: skip
    assert load.uses_copy_engine == (len(slots) < MAX_COPY_RUNS + 1)
    for layer in range(num_layers):  # each layer's wait covers that layer
        load.wait_layer(layer)
        assert torch.equal(cache[layer], expected[layer]), layer
    load.done.synchronize()  # `done` covers every layer, on either stream
    assert torch.equal(cache, expected)


def test_a_layer_load_refuses_pageable_host_memory() -> None:
    cache = torch.zeros((4, 2, 8, BS, 2, 64), device="cuda", dtype=torch.bfloat16)
    host = torch.zeros((4, 4, 2, BS, 2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pinned"):
        LayerLoad(host, [0], cache, [1], torch.cuda.Stream())


def make_worker(  # type: ignore[no-untyped-def]
    weights, layered: bool, *, host_slots: int = 64, copy_engine: bool = True
):
    config = small_config()
    runner = ModelRunner(config, 12, BS, device="cuda", dtype=torch.float32, weights=weights)
    runner.block_io.layered_loads = layered
    if not copy_engine:
        runner.block_io.copy_engine = None
    shape = (*runner.kv_cache.shape[:2], *runner.kv_cache.shape[3:])
    host = HostPool(host_slots, shape, torch.float32, pin=True) if host_slots else None
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    worker = Worker(
        "w",
        runner,
        config.fingerprint(),
        SchedulerConfig(BS, 8, 4096),
        logits_sink=lambda rid, row: logits[rid].append(row),
        host_pool=host,
    )
    return worker, logits


def run(worker: Worker, rid: str, prompt: list[int], max_tokens: int = 6) -> list[RequestOutput]:
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    worker.add_request(WorkerRequest(rid, tuple(prompt), sampling))
    outs: list[RequestOutput] = []
    while worker.has_work:
        outs += [o for o in worker.step() if o.request_id == rid]
        worker.check_invariants()
    return outs


@pytest.mark.parametrize("copy_engine", [True, False])
@pytest.mark.parametrize("write_back", [False, True])
def test_a_prompt_promoted_layer_by_layer_matches_a_cold_run(
    write_back: bool, copy_engine: bool
) -> None:
    weights = random_weights(small_config(), seed=0, device="cuda", dtype=torch.float32)
    results = {}
    for layered in (True, False):
        worker, logits = make_worker(weights, layered, copy_engine=copy_engine)
        run(worker, "a", PREFIX + [1])
        for k in range(3):  # push the prefix out of the 12-block device pool
            while write_back and worker.write_back_host(look_ahead=12):
                pass
            run(worker, f"f{k}", [(i * (k + 11)) % 250 + 3 for i in range(150)], max_tokens=4)
        outs = run(worker, "again", PREFIX + [1])
        facts = outs[0].prefill
        assert facts is not None and facts.host_tokens > 0
        assert (worker.runner.block_io.num_layer_loads > 0) == layered
        if worker.runner.block_io.copy_engine is None:
            assert worker.runner.block_io.num_copy_engine_loads == 0
        elif layered:  # a fresh host pool hands out its slots in order: they come in runs
            assert worker.runner.block_io.num_copy_engine_loads > 0
        results[layered] = ([t for o in outs for t in o.new_token_ids], logits["again"])
    cold, cold_logits = make_worker(weights, True, host_slots=0)
    expected = [t for o in run(cold, "again", PREFIX + [1]) for t in o.new_token_ids]
    (layered_tokens, layered_rows), (copied_tokens, copied_rows) = results[True], results[False]
    assert layered_tokens == copied_tokens == expected
    for a, b, c in zip(layered_rows, copied_rows, cold_logits["again"], strict=True):
        assert torch.equal(a, b)  # the same bytes in the cache, the same kernels
        torch.testing.assert_close(a, c, atol=1e-3, rtol=0)  # cached vs fresh attention kernels


def test_a_worker_built_with_a_host_tier_compiles_its_layer_load_up_front() -> None:
    from kvmesh.workers.config import WorkerConfig
    from kvmesh.workers.model.loader import build_worker

    config = WorkerConfig(
        "w", model="tiny-random", num_blocks=64, host_cache_gb=0.01, device="cuda"
    )
    worker = build_worker(config)
    runner = worker.runner
    assert runner.block_io.num_layer_loads == (2 if runner.block_io.copy_engine is not None else 1)
    assert runner.block_io.num_copy_engine_loads == runner.block_io.num_layer_loads - 1
    assert worker.pool.num_cached == 0 and worker.pool.num_free == worker.pool.num_blocks
    assert worker.host_pool is not None and worker.host_pool.num_cached == 0
