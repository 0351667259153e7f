"""Pulled and tier-promoted KV must give exactly what recomputing gives."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvmesh.coordinator.index.mirror import IndexMirror, WorkerId
from kvmesh.coordinator.routing.links import LinkTable, LinkType, link_type
from kvmesh.proto.block_hash import BlockHash, block_hashes
from kvmesh.proto.events import TIER_DEVICE, TIER_HOST, BlockStored
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import PullSpec, SamplingConfig, WorkerRequest
from kvmesh.workers.engine.pull_admission import PullTiming
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import BlockWriter, PullTargets, Worker
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import BlockPairs, copy_block_runs, copy_blocks
from kvmesh.workers.transfer.object_store import export_writer

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


def request(
    rid: str, prompt: list[int], max_tokens: int = 6, pull: PullSpec | None = None
) -> WorkerRequest:
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    return WorkerRequest(rid, tuple(prompt), sampling, pull=pull)


def run(worker: Worker, rid: str, prompt: list[int], max_tokens: int = 6) -> list[RequestOutput]:
    worker.add_request(request(rid, prompt, max_tokens))
    return finish(worker, rid)


def finish(worker: Worker, rid: str) -> list[RequestOutput]:
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


def chain_of(worker: Worker, prompt: list[int]) -> list[BlockHash]:
    return block_hashes(prompt, BS, worker.root_hash())


def object_store_fill(peer: Worker, hashes: tuple[BlockHash, ...], target: Worker) -> BlockWriter:
    """What the object-store transport does, in process: the peer exports, the target scatters."""
    return export_writer(target.runner, peer.pull_source.export_blocks(hashes))


def pull(target: Worker, peer: Worker, rid: str, prompt: list[int], spec: PullSpec) -> int:
    """Accept a request with a pull plan and run the pull the way the actor does."""
    reservation = target.add_request(request(rid, prompt, pull=spec))
    assert reservation is not None
    target.check_invariants()
    written = target.write_pull(rid, object_store_fill(peer, spec.hashes, target))
    return target.finish_pull(rid, written, PullTiming(1.0))


def warm_peer() -> Worker:
    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX + [1])
    return peer


def test_a_pulled_prefix_is_reused_and_matches_a_cold_recompute() -> None:
    peer = warm_peer()
    target, logits = make_worker("target")
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    assert pull(target, peer, "req", prompt, PullSpec("peer", 0, tuple(chain[:6]))) == 6
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None
    assert (facts.pulled_tokens, facts.local_tokens, facts.computed_tokens) == (96, 0, 2)
    assert facts.pull_bytes == 6 * target.block_num_bytes
    assert_same_as_cold(outs, logits, "req", prompt)
    assert target.pool.num_free == target.pool.num_blocks  # nothing leaked
    assert target.info().counters.pulled_tokens == 96


def test_a_plan_that_starts_inside_what_the_worker_holds_writes_only_the_rest() -> None:
    # The source was asked for the plan before the target reserved: the target held the plan's
    # first two blocks by then, so the source's run is lined up past them.
    peer = warm_peer()
    target, logits = make_worker("target")
    run(target, "head", PREFIX[:32] + [1])
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    spec = PullSpec("peer", 0, tuple(chain[:6]))
    reservation = target.add_request(request("req", prompt, pull=spec))
    assert reservation is not None and len(reservation.local) == 2
    assert target.write_pull("req", object_store_fill(peer, spec.hashes, target)) == 4
    assert target.finish_pull("req", 4, PullTiming(1.0)) == 4
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None and (facts.local_tokens, facts.pulled_tokens) == (32, 64)
    assert_same_as_cold(outs, logits, "req", prompt)


def test_a_plan_that_starts_past_what_the_worker_holds_writes_nothing() -> None:
    # The coordinator believed the target held two blocks it does not: nothing the source
    # sends lines up with the reservation, so the request recomputes.
    peer = warm_peer()
    target, logits = make_worker("target")
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    spec = PullSpec("peer", 2, tuple(chain[2:6]))
    reservation = target.add_request(request("req", prompt, pull=spec))
    assert reservation is not None and reservation.local == ()
    assert target.write_pull("req", object_store_fill(peer, spec.hashes, target)) == 0
    assert target.finish_pull("req", 0, PullTiming(1.0)) == 0
    outs = finish(target, "req")
    assert outs[0].prefill is not None and outs[0].prefill.computed_tokens == 98
    assert_same_as_cold(outs, logits, "req", prompt)
    target.check_invariants()


def test_pull_targets_line_up_with_the_plan() -> None:
    assert PullTargets([5, 6, 7], first=0).fillable(2) == 2
    assert PullTargets([5, 6, 7], first=2).fillable(6) == 3
    assert PullTargets([5, 6, 7], first=2).fillable(4) == 2
    assert PullTargets([5, 6, 7], first=2).fillable(2) == 0
    assert PullTargets([5, 6, 7], first=-1).fillable(9) == 0
    assert PullTargets([]).fillable(9) == 0


def test_pulled_blocks_stay_pinned_until_their_request_is_admitted() -> None:
    peer = warm_peer()
    target, _ = make_worker("target", num_blocks=16)
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    pull(target, peer, "req", prompt, PullSpec("peer", 0, tuple(chain[:6])))
    # Everything else that is free gets reallocated before the request's first step...
    squatter = target.pool.allocate(target.pool.num_free)
    assert squatter is not None
    assert len(target.pool.match_prefix(chain)) == 6  # ...and the pulled run survives it
    target.pool.free(squatter)
    outs = finish(target, "req")
    assert outs[0].prefill is not None and outs[0].prefill.pulled_tokens == 96


def test_the_local_prefix_is_pinned_with_the_pulled_run() -> None:
    peer = warm_peer()
    target, logits = make_worker("target", num_blocks=16)
    prompt = PREFIX + [7, 7]
    run(target, "local", PREFIX[:32] + [1])  # target holds blocks 0, 1 itself
    chain = chain_of(target, prompt)
    assert pull(target, peer, "req", prompt, PullSpec("peer", 2, tuple(chain[2:6]))) == 4
    squatter = target.pool.allocate(target.pool.num_free)
    assert squatter is not None and len(target.pool.match_prefix(chain)) == 6
    target.pool.free(squatter)
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None and (facts.local_tokens, facts.pulled_tokens) == (32, 64)
    assert_same_as_cold(outs, logits, "req", prompt)


def test_a_failed_pull_releases_its_blocks_and_the_request_recomputes() -> None:
    target, logits = make_worker("target")
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    reservation = target.add_request(
        request("req", prompt, pull=PullSpec("peer", 0, tuple(chain[:6])))
    )
    assert reservation is not None and len(reservation.targets) == 6

    def broken(targets: PullTargets) -> int:
        raise ValueError("peer went away mid-copy")

    with pytest.raises(ValueError):
        target.write_pull("req", broken)
    assert target.finish_pull("req", 0, PullTiming(1.0)) == 0
    target.check_invariants()
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None and (facts.pulled_tokens, facts.computed_tokens) == (0, 98)
    assert_same_as_cold(outs, logits, "req", prompt)
    assert target.pool.num_free == target.pool.num_blocks
    assert target.info().counters.num_failed_pulls == 1


def test_aborting_a_request_while_it_pulls_releases_the_reservation() -> None:
    peer = warm_peer()
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    chain = chain_of(target, prompt)
    reservation = target.add_request(
        request("req", prompt, pull=PullSpec("peer", 0, tuple(chain[:6])))
    )
    assert reservation is not None
    assert target.abort("req")
    target.check_invariants()
    # The transport still runs its writer (it must consume what a peer sends) over no blocks.
    assert target.write_pull("req", object_store_fill(peer, reservation.hashes, target)) == 0
    assert target.finish_pull("req", 0, PullTiming(1.0)) == 0
    target.check_invariants()
    assert target.pool.num_free == target.pool.num_blocks and target.pool.num_cached == 0


def test_a_plan_for_another_chain_is_ignored_and_the_request_recomputes() -> None:
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    wrong = tuple(BlockHash(h + 1) for h in chain_of(target, prompt)[:6])
    assert target.add_request(request("req", prompt, pull=PullSpec("peer", 0, wrong))) is None
    outs = finish(target, "req")
    assert outs[0].prefill is not None and outs[0].prefill.computed_tokens == 98


def test_a_pull_never_covers_the_block_of_the_last_prompt_token() -> None:
    target, _ = make_worker("target")
    prompt = PREFIX  # 6 full blocks: the last one holds the last prompt token
    chain = chain_of(target, prompt)
    reservation = target.add_request(request("req", prompt, pull=PullSpec("peer", 0, tuple(chain))))
    assert reservation is not None and len(reservation.targets) == 5
    target.abort("req")


def test_export_stops_at_the_first_missing_block() -> None:
    peer, _ = make_worker("peer")
    run(peer, "warm", PREFIX[:40])  # 2 full blocks
    assert len(peer.pull_source.export_blocks(chain_of(peer, PREFIX)).hashes) == 2


def test_demoted_blocks_are_promoted_back_with_the_same_result() -> None:
    worker, logits = make_worker("w", num_blocks=10, host_slots=64)  # 160 device tokens
    run(worker, "a", PREFIX + [1])
    for k in range(3):  # evict the prefix from the device
        run(worker, f"f{k}", [(i * (k + 11)) % 250 + 3 for i in range(120)], max_tokens=4)
    chain = chain_of(worker, PREFIX)
    assert len(worker.pool.match_prefix(chain)) < 6
    assert worker.host_pool is not None and worker.host_pool.match(chain) >= 1
    prompt = PREFIX + [1]
    outs = run(worker, "again", prompt)
    facts = outs[0].prefill
    assert facts is not None and facts.host_tokens > 0
    assert facts.cached_tokens == 96 and facts.computed_tokens == 1
    assert worker.info().counters.host_hit_tokens > 0
    assert_same_as_cold(outs, logits, "again", prompt)


@pytest.mark.parametrize("write_back", [False, True])
def test_tier_events_keep_a_mirror_equal_to_both_pools(write_back: bool) -> None:
    worker, _ = make_worker("w", num_blocks=10, host_slots=8)
    mirror = IndexMirror()
    mirror.load_worker(WorkerId("w"), worker.generation, 0, [])
    prompts = [[(i * (k + 3)) % 250 + 3 for i in range(70)] for k in range(6)]
    for k, p in enumerate(prompts + prompts[:2]):
        run(worker, f"r{k}", p, max_tokens=3)
        if write_back:  # copies made ahead of eviction stay unannounced until it happens
            worker.write_back_host(look_ahead=6)
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
    peer = warm_peer()
    target, logits = make_worker("target")
    prompt = PREFIX + [3, 4]
    chain = chain_of(target, prompt)
    spec = PullSpec("peer", 0, tuple(chain[:6]))
    reservation = target.add_request(request("req", prompt, pull=spec))
    assert reservation is not None
    ids = peer.pull_source.pin_run(spec.hashes)
    assert len(ids) == 6 and all(peer.pool.ref_count(b) == 1 for b in ids)
    peer.check_invariants()  # the peer's pins are accounted for

    def fill(targets: PullTargets) -> int:
        dst = [int(b) for b in targets.blocks]
        copy_blocks(target.runner.kv_cache, dst, peer.runner.kv_cache, ids)
        return len(dst)

    written = target.write_pull("req", fill)
    peer.pull_source.unpin(ids)
    peer.check_invariants()
    assert target.finish_pull("req", written, PullTiming(1.0)) == 6
    assert peer.pool.num_free == peer.pool.num_blocks
    outs = finish(target, "req")
    assert outs[0].prefill is not None and outs[0].prefill.pulled_tokens == 96
    assert_same_as_cold(outs, logits, "req", prompt)


def test_block_runs_are_copied_in_as_few_slices_as_possible() -> None:
    src = torch.arange(2 * 2 * 30 * 3, dtype=torch.float32).reshape(2, 2, 30, 3)
    dst = torch.zeros(2, 2, 30, 3)
    src_ids, dst_ids = [7, 8, 9, 2, 3, 4], [10, 11, 12, 13, 20, 21]
    assert copy_block_runs(dst, dst_ids, src, src_ids) == 3
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    with pytest.raises(ValueError):
        copy_block_runs(dst, [1], src, [1, 2])


def test_blocks_written_back_while_idle_are_evicted_without_another_copy() -> None:
    worker, _ = make_worker("w", num_blocks=10, host_slots=64)
    run(worker, "a", PREFIX + [1])
    host = worker.host_pool
    assert host is not None
    worker.drain_event_batch()
    while worker.write_back_host(look_ahead=10):  # the actor's idle ticks
        pass
    assert worker.drain_event_batch() is None  # the device still holds them: nothing announced
    next_out = worker.pool.next_evicted(10)
    hashes = [h for _b, h in next_out]
    assert hashes and not host.missing(hashes)
    assert worker.write_back_host(look_ahead=10) == 0  # nothing left to do
    first_block, first_hash = next_out[0]
    worker.runner.kv_cache[:, :, first_block] = 7.0  # a second copy would carry this
    taken = worker.pool.allocate(worker.pool.num_free)  # a request takes all the room
    assert taken is not None
    worker.host_tier.demote_evicted()
    batch = worker.drain_event_batch()
    assert batch is not None
    announced = [
        h
        for e in batch.events
        if isinstance(e, BlockStored) and e.tier == TIER_HOST
        for h in e.hashes
    ]
    assert sorted(announced) == sorted(hashes)
    assert not torch.all(host.get([first_hash]) == 7.0)
    worker.pool.free(taken)
    host.check_invariants()


def test_an_idle_write_back_tick_copies_at_most_its_bytes() -> None:
    """A request arriving during a tick waits for it: a tick is bounded in bytes, not blocks."""
    worker, _ = make_worker("w", num_blocks=10, host_slots=64)
    run(worker, "a", PREFIX + [1])
    host = worker.host_pool
    assert host is not None
    block = worker.runner.block_io.block_num_bytes
    assert worker.host_tier.write_back(look_ahead=10, max_bytes=3 * block + 1) == 3
    assert worker.host_tier.write_back(look_ahead=10, max_bytes=1) == 1  # at least a block
    copied = 4
    while n := worker.host_tier.write_back(look_ahead=10, max_bytes=2 * block):
        assert n <= 2
        copied += n
    hashes = [h for _b, h in worker.pool.next_evicted(10)]
    assert copied == len(hashes) and not host.missing(hashes)
    host.check_invariants()


def test_a_prefix_written_back_ahead_is_promoted_with_the_same_result() -> None:
    worker, logits = make_worker("w", num_blocks=10, host_slots=64)  # 160 device tokens
    run(worker, "a", PREFIX + [1])
    for k in range(3):  # evict the prefix from the device, writing back while idle
        while worker.write_back_host(look_ahead=10):
            pass
        run(worker, f"f{k}", [(i * (k + 11)) % 250 + 3 for i in range(120)], max_tokens=4)
    chain = chain_of(worker, PREFIX)
    assert len(worker.pool.match_prefix(chain)) < 6
    prompt = PREFIX + [1]
    outs = run(worker, "again", prompt)
    facts = outs[0].prefill
    assert facts is not None and facts.host_tokens > 0
    assert facts.cached_tokens == 96
    assert_same_as_cold(outs, logits, "again", prompt)


def test_write_back_stops_within_half_the_host_tier() -> None:
    worker, _ = make_worker("w", num_blocks=10, host_slots=6)  # fewer slots than blocks
    run(worker, "a", PREFIX + [1])
    run(worker, "b", [(i * 7) % 250 + 3 for i in range(120)])  # every block now holds KV
    copied = []
    while n := worker.write_back_host(look_ahead=10):
        copied.append(n)
        assert len(copied) < 10, "an idle worker kept copying"
    assert 0 < sum(copied) <= 3  # half of the 6 slots look ahead; some were there already
    assert worker.host_pool is not None
    assert not worker.host_pool.missing([h for _b, h in worker.pool.next_evicted(3)])
    assert worker.write_back_host(look_ahead=10) == 0


def test_block_pairs_must_pair_every_block() -> None:
    with pytest.raises(ValueError, match="2 destination blocks for 3 sources"):
        BlockPairs([1, 2, 3], [4, 5])
