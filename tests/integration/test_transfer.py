"""Pulls between real worker actors (Ray object store) through the real coordinator."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import ray
import redis

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import redis_schema as schema
from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

# 1,024 tokens: recomputing them costs more than moving their KV, so the router plans a pull.
PREFIX = [(i * 13) % 250 + 3 for i in range(1024)]


def held(stub, tokens: list[int], worker: str) -> int:  # type: ignore[no-untyped-def]
    resp = stub.Lookup(pb.LookupRequest(token_ids=tokens))
    return next((m.matched_blocks for m in resp.matches if m.worker_id == worker), 0)


def test_forced_worker_pulls_a_prefix_that_lives_on_its_peer(ray_session: None) -> None:
    d = start_deployment(num_workers=2, num_blocks=256)
    try:
        assert d.cluster is not None and d.redis is not None
        stub = stub_for(d.address)
        local = generate(stub, PREFIX + [1, 2], max_tokens=5, worker_id="w0")
        wait_for(lambda: held(stub, PREFIX, "w0") == 64, what="w0's prefix in the index")

        pulled = generate(stub, PREFIX + [1, 2], max_tokens=5, worker_id="w1")
        facts = pulled[0].cache
        assert facts.worker_id == "w1"
        assert facts.pulled_tokens == 1024 and facts.cached_tokens == 0
        assert facts.computed_tokens == 2
        tokens = [t for r in pulled for t in r.token_ids]
        assert tokens == [t for r in local for t in r.token_ids]  # same as computing it locally

        # Imported blocks are announced like computed ones, and both pools stay consistent.
        client = redis.Redis.from_url(d.redis.url)
        wait_for(lambda: client.hlen(schema.worker_blocks_key("w1")) >= 64, what="w1 announced")
        for w in ("w0", "w1"):
            assert ray.get(d.cluster.actor(w).check_invariants.remote())
        stats = stub.Stats(pb.StatsRequest())
        assert stats.pulled_tokens == 1024 and stats.num_pulls == 1

        # A second request on w1 now hits locally.
        again = generate(stub, PREFIX + [9], max_tokens=2, worker_id="w1")
        assert again[0].cache.cached_tokens == 1024 and again[0].cache.pulled_tokens == 0
    finally:
        d.stop()


def test_a_peer_on_the_same_node_pins_and_unpins_over_its_channel(ray_session: None) -> None:
    from kvmesh.workers.transfer.peer_channel import ChannelError
    from kvmesh.workers.transfer.peer_source import PeerSource

    d = start_deployment(num_workers=1, num_blocks=256)
    try:
        assert d.cluster is not None
        stub = stub_for(d.address)
        generate(stub, PREFIX + [1, 2], max_tokens=2, worker_id="w0")
        wait_for(lambda: held(stub, PREFIX, "w0") == 64, what="w0's prefix in the index")
        actor = d.cluster.actor("w0")
        hashes = ray.get(actor.cached_hashes.remote())
        free_before = ray.get(actor.info.remote()).num_free_blocks

        async def scenario() -> None:
            source = PeerSource(actor, ray.get_runtime_context().get_node_id())
            assert await source.channel() is not None  # same node: the socket, not Ray
            ids = await source.pin(hashes)
            assert len(ids) == len(hashes) >= 64
            assert ray.get(actor.info.remote()).num_free_blocks == free_before - len(ids)
            assert ray.get(actor.check_invariants.remote())
            assert await source.nccl_accept(hashes, 0) is None  # no NCCL group on a CPU
            await source.unpin(ids)
            assert ray.get(actor.info.remote()).num_free_blocks == free_before
            ray.kill(actor)
            # Ray calls it dead at once; its process (and so its socket) goes a moment later.
            deadline = time.monotonic() + 20
            with pytest.raises(ChannelError):
                while time.monotonic() < deadline:
                    await source.pin(hashes)
                    await asyncio.sleep(0.05)

        asyncio.run(scenario())
    finally:
        d.stop()


def test_a_pull_from_a_dead_peer_falls_back_to_recompute(ray_session: None) -> None:
    d = start_deployment(num_workers=2, num_blocks=256)
    try:
        assert d.cluster is not None
        stub = stub_for(d.address)
        generate(stub, PREFIX + [5], max_tokens=2, worker_id="w0")
        wait_for(lambda: held(stub, PREFIX, "w0") == 64, what="w0's prefix in the index")
        ray.kill(d.cluster.actor("w0"), no_restart=True)
        # Straight after the kill: the pull fails (or is not planned once the death is noticed);
        # either way the request succeeds by recomputing and nothing leaks.
        out = generate(stub, PREFIX + [6], max_tokens=3, worker_id="w1")
        assert out[0].cache.pulled_tokens == 0 and out[0].cache.computed_tokens == 1025
        assert ray.get(d.cluster.actor("w1").check_invariants.remote())
        assert ray.get(d.cluster.actor("w1").info.remote()).counters.num_failed_pulls <= 1
        wait_for(lambda: not d.cluster.is_alive("w0"), what="w0 marked dead")  # type: ignore[union-attr]
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, PREFIX, worker_id="w0")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        d.stop()


def test_a_prompt_pushed_to_the_host_tier_is_served_from_it(ray_session: None) -> None:
    # 16 device blocks; the idle worker copies its next evictions to the host tier ahead.
    d = start_deployment(num_workers=1, num_blocks=16, host_cache_gb=0.01)
    try:
        assert d.cluster is not None
        stub = stub_for(d.address)
        prompt = PREFIX[:96] + [1]  # 6 full blocks
        first = generate(stub, prompt, max_tokens=4, worker_id="w0")
        for k in range(3):  # evict it from the device pool (and give the worker idle time)
            other = [(i * (k + 11)) % 250 + 3 for i in range(200)]
            generate(stub, other, max_tokens=2, worker_id="w0")
        again = generate(stub, prompt, max_tokens=4, worker_id="w0")
        assert again[0].cache.cached_tokens == 96 and again[0].cache.computed_tokens == 1
        assert [t for r in again for t in r.token_ids] == [t for r in first for t in r.token_ids]
        wait_for(
            lambda: stub.Stats(pb.StatsRequest()).cache.host_hit_tokens >= 96,
            what="the worker's report of its host-tier hit",
        )
        assert ray.get(d.cluster.actor("w0").check_invariants.remote())
    finally:
        d.stop()
