"""A true reset (the cache epoch), the prefix-cache switches and the worker's cache figures,
on the worker engine without Ray."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch

from kvmesh.proto.events import BlockStored
from kvmesh.workers.contract.replies import CacheStats, RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner

BS = 16
PREFIX = [(i * 7) % 250 + 3 for i in range(64)]  # 4 full blocks


def make_worker(*, max_num_seqs: int = 8, prefix_cache: bool = True) -> Worker:
    config = preset("tiny-random")
    runner = ModelRunner(config, 64, BS, device="cpu", dtype=torch.float32, seed=0)
    return Worker(
        "w0",
        runner,
        config.fingerprint(),
        SchedulerConfig(BS, max_num_seqs, 4096),
        clock=lambda: 0.0,
        prefix_cache=prefix_cache,
    )


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> WorkerRequest:
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    return WorkerRequest(rid, tuple(prompt), sampling, **kw)  # type: ignore[arg-type]


def run(worker: Worker, *requests: WorkerRequest) -> dict[str, list[RequestOutput]]:
    for r in requests:
        worker.add_request(r)
    return drain(worker)


def drain(worker: Worker) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    while worker.has_work:
        for o in worker.step():
            outs[o.request_id].append(o)
        worker.check_invariants()
    return outs


def local_tokens(outs: list[RequestOutput]) -> int:
    facts = outs[0].prefill
    assert facts is not None
    return facts.local_tokens


def test_reset_leaves_a_running_requests_blocks_unmatchable() -> None:
    w = make_worker()
    w.add_request(req("running", PREFIX + [1], max_tokens=30))
    w.step()  # prefilled: its 4 prompt blocks are registered and held
    assert w.pool.num_cached == 4
    old_root = w.root_hash()
    w.clear_cache()
    assert w.cache_epoch == 1 and w.root_hash() != old_root
    assert w.pool.num_cached == 4  # still held by the running request, under the old epoch
    outs = run(w, req("after", PREFIX + [2]))
    assert local_tokens(outs["after"]) == 0  # nothing computed before the reset is matched
    assert len(outs["running"]) == 29  # the running request went on
    again = run(w, req("again", PREFIX + [3]))
    assert local_tokens(again["again"]) == 64  # what was computed after the reset is reused


def test_reset_rehashes_a_request_still_waiting() -> None:
    w = make_worker(max_num_seqs=1)
    w.add_request(req("running", PREFIX + [1], max_tokens=30))
    w.step()
    w.add_request(req("waiting", PREFIX + [2]))  # queued behind the running one
    w.clear_cache(5)
    assert w.cache_epoch == 5  # a given epoch (the fleet's) is taken when higher
    outs = drain(w)
    assert local_tokens(outs["waiting"]) == 0


def test_full_state_after_a_reset_republishes_links() -> None:
    w = make_worker()
    run(w, req("a", PREFIX + [1]))
    w.clear_cache()
    run(w, req("b", PREFIX + [1]))
    batch = w.full_state_batch()
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [(e.parent_hash, e.depth, len(e.hashes)) for e in stored] == [(w.root_hash(), 1, 4)]


def test_bypass_cache_reuses_nothing_and_leaves_nothing() -> None:
    w = make_worker()
    run(w, req("warm", PREFIX + [1]))
    w.drain_event_batch()
    num_cached = w.pool.num_cached
    outs = run(w, req("bypass", PREFIX + [1], bypass_cache=True))
    facts = outs["bypass"][0].prefill
    assert facts is not None and facts.cached_tokens == 0 and facts.computed_tokens == 65
    assert w.pool.num_cached == num_cached
    batch = w.drain_event_batch()
    assert batch is None or not any(isinstance(e, BlockStored) for e in batch.events)
    cache = w.info().cache
    assert (cache.num_lookup_hits, cache.num_lookup_misses) == (0, 1)  # bypass: neither


def test_no_prefix_cache_computes_every_prompt_whole() -> None:
    w = make_worker(prefix_cache=False)
    run(w, req("a", PREFIX + [1]))
    outs = run(w, req("b", PREFIX + [1]))
    assert local_tokens(outs["b"]) == 0
    assert w.pool.num_cached == 0
    assert w.info().cache.enabled is False


def test_cache_figures_add_up() -> None:
    w = make_worker()
    run(w, req("miss", PREFIX + [1]))
    run(w, req("hit", PREFIX + [2]))
    c = w.info().cache
    assert (c.num_lookup_hits, c.num_lookup_misses) == (1, 1)
    assert c.local_hit_tokens == 64
    assert c.saved_prefill_tokens == c.local_hit_tokens + c.host_hit_tokens + c.pulled_hit_tokens
    assert c.num_device_entries == w.pool.num_cached and c.num_host_entries == 0
    assert c.num_bytes == c.num_entries * w.block_num_bytes
    assert (c.block_size, c.kv_dtype, c.enabled) == (BS, "float32", True)
    other = replace(c, kv_dtype="bfloat16", cache_epoch=3, enabled=False)
    total = CacheStats.total([c, other])
    assert total.num_lookup_hits == 2 and total.saved_prefill_tokens == 128
    assert (total.kv_dtype, total.cache_epoch, total.enabled) == ("bfloat16,float32", 3, False)
    assert total.num_entries == 2 * c.num_entries
