"""Pulled and tier-promoted KV must give exactly what recomputing gives."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvmesh.coordinator.index.mirror import IndexMirror, WorkerId
from kvmesh.proto.events import TIER_DEVICE, TIER_HOST
from kvmesh.workers.engine.sampler import SamplingConfig
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import RequestOutput, Worker, WorkerRequest
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.links import BlockExport, LinkTable, LinkType, link_type

BS = 16
CONFIG = preset("tiny-random")
PREFIX = [(i * 5) % 250 + 3 for i in range(96)]  # 6 blocks


def make_worker(name: str, num_blocks: int = 64, host_slots: int = 0) -> tuple[Worker, dict]:
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    runner = ModelRunner(CONFIG, num_blocks, BS, device="cpu", dtype=torch.float32, seed=0)
    host = None
    if host_slots:
        shape = (*runner.kv_cache.shape[:2], *runner.kv_cache.shape[3:])
        host = HostPool(host_slots, shape, torch.float32, pin=False)
    worker = Worker(
        name,
        runner,
        CONFIG.fingerprint(),
        SchedulerConfig(BS, 8, 4096),
        logits_sink=lambda rid, row: logits[rid].append(row),
        host_pool=host,
    )
    return worker, logits


def run(worker: Worker, rid: str, prompt: list[int], max_tokens: int = 6) -> list[RequestOutput]:
    worker.add_request(
        WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, ignore_eos=True))
    )
    outs = []
    while worker.has_work:
        outs += [o for o in worker.step() if o.request_id == rid]
        worker.check_invariants()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_same_as_cold(outs, logits, rid: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    cold, cold_logits = make_worker("cold")
    expected = run(cold, rid, prompt)
    assert tokens(outs) == tokens(expected)
    for a, b in zip(logits[rid], cold_logits[rid], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_pulled_prefix_is_reused_and_matches_a_cold_recompute() -> None:
    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX + [1])
    target, logits = make_worker("target")
    root = target.root_hash()
    from kvmesh.proto.block_hash import block_hashes

    chain = block_hashes(PREFIX, BS, root)
    export = peer.export_blocks(chain)
    assert export.hashes == tuple(chain) and export.blocks.shape[0] == 6
    assert target.import_blocks(export, root) == 6
    target.check_invariants()
    assert target.pool.num_free == target.pool.num_blocks  # imported blocks are free but cached
    prompt = PREFIX + [7, 7]
    outs = run(target, "req", prompt)
    assert outs[0].cached_tokens == 96
    assert_same_as_cold(outs, logits, "req", prompt)


def test_export_stops_at_the_first_missing_block() -> None:
    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX[:40])  # 2 full blocks
    from kvmesh.proto.block_hash import block_hashes

    chain = block_hashes(PREFIX, BS, peer.root_hash())
    assert len(peer.export_blocks(chain).hashes) == 2


def test_a_failed_import_releases_its_blocks() -> None:
    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX + [1])
    target, _ = make_worker("target")
    from kvmesh.proto.block_hash import block_hashes

    chain = block_hashes(PREFIX, BS, target.root_hash())
    good = peer.export_blocks(chain)
    wrong_dtype = BlockExport("peer", good.hashes, good.blocks.to(torch.float64))
    with pytest.raises(ValueError):
        target.import_blocks(wrong_dtype, target.root_hash())
    target.check_invariants()
    assert target.pool.num_free == target.pool.num_blocks and target.pool.num_cached == 0
    truncated = BlockExport("peer", good.hashes, good.blocks[:3])
    with pytest.raises(ValueError, match="3 blocks for 6 hashes"):
        target.import_blocks(truncated, target.root_hash())
    target.check_invariants()


def test_demoted_blocks_are_promoted_back_with_the_same_result() -> None:
    worker, logits = make_worker("w", num_blocks=10, host_slots=64)  # 160 device tokens
    run(worker, "a", PREFIX + [1])
    for k in range(3):  # evict the prefix from the device
        run(worker, f"f{k}", [(i * (k + 11)) % 250 + 3 for i in range(120)], max_tokens=4)
    from kvmesh.proto.block_hash import block_hashes

    chain = block_hashes(PREFIX, BS, worker.root_hash())
    assert len(worker.pool.match_prefix(chain)) < 6
    assert worker.host_pool is not None and worker.host_pool.match(chain) >= 1
    prompt = PREFIX + [1]
    outs = run(worker, "again", prompt)
    assert worker.counters.host_hit_tokens > 0
    assert outs[0].cached_tokens == 96
    assert_same_as_cold(outs, logits, "again", prompt)


def test_tier_events_keep_a_mirror_equal_to_both_pools() -> None:
    worker, _ = make_worker("w", num_blocks=10, host_slots=8)
    mirror = IndexMirror()
    mirror.load_worker(WorkerId("w"), worker.generation, 0, [])
    prompts = [[(i * (k + 3)) % 250 + 3 for i in range(70)] for k in range(6)]
    for k, p in enumerate(prompts + prompts[:2]):
        run(worker, f"r{k}", p, max_tokens=3)
        batch = worker.drain_event_batch()
        if batch is not None:
            mirror.apply(batch)
    expected = {h: TIER_HOST for h in worker.host_pool.cached_hashes()}  # type: ignore[union-attr]
    expected.update({h: TIER_DEVICE for h in worker.pool.cached_hashes()})
    assert mirror.worker_hashes(WorkerId("w")) == expected
    mirror.check_invariants()


def test_link_table_prices_by_type_and_learns_from_observations() -> None:
    table = LinkTable()
    assert link_type("n1", "cuda:0", "n1", "cuda:0") is LinkType.SAME_DEVICE
    assert link_type("n1", "cpu", "n1", "cpu") is LinkType.SAME_NODE
    assert link_type("n1", "cuda:0", "n2", "cuda:0") is LinkType.OTHER_NODE
    before = table.transfer_ms(LinkType.SAME_NODE, 10**6)
    latency = table.latency_ms[LinkType.SAME_NODE]
    table.observe(LinkType.SAME_NODE, 10**6, elapsed_ms=latency + 0.01)  # faster than assumed
    assert table.transfer_ms(LinkType.SAME_NODE, 10**6) < before
    table.observe(LinkType.SAME_NODE, 10**6, elapsed_ms=latency / 2)  # below latency: ignored
    assert table.transfer_ms(LinkType.SAME_NODE, 0) == latency
    with pytest.raises(ValueError):
        table.set(LinkType.SAME_NODE, 0)


def test_in_place_copy_from_a_pinned_peer_cache_matches_a_cold_recompute() -> None:
    # The same-GPU path (CUDA IPC maps the peer's cache); here both caches live in one process.
    from kvmesh.proto.block_hash import block_hashes

    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX + [1])
    target, logits = make_worker("target")
    chain = block_hashes(PREFIX, BS, target.root_hash())
    ids = peer.pin_run(chain)
    assert len(ids) == 6 and all(peer.pool.ref_count(b) == 1 for b in ids)
    held = target.import_from_peer_cache(peer.runner.kv_cache, ids, chain, target.root_hash())
    peer.unpin(ids)
    peer.check_invariants()
    assert held == 6 and peer.pool.num_free == peer.pool.num_blocks
    prompt = PREFIX + [3, 4]
    outs = run(target, "req", prompt)
    assert outs[0].cached_tokens == 96
    assert_same_as_cold(outs, logits, "req", prompt)


def test_block_runs_are_copied_in_as_few_slices_as_possible() -> None:
    from kvmesh.workers.transfer.links import copy_block_runs

    src = torch.arange(2 * 2 * 30 * 3, dtype=torch.float32).reshape(2, 2, 30, 3)
    dst = torch.zeros(2, 2, 30, 3)
    src_ids, dst_ids = [7, 8, 9, 2, 3, 4], [10, 11, 12, 13, 20, 21]
    assert copy_block_runs(dst, dst_ids, src, src_ids) == 3
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    with pytest.raises(ValueError):
        copy_block_runs(dst, [1], src, [1, 2])
