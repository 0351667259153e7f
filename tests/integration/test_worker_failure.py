"""Killing worker actors for real: their index entries go, the service keeps answering."""

from __future__ import annotations

import grpc
import pytest
import ray
import redis

from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import redis_schema as schema
from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]


def test_killed_worker_is_purged_and_later_requests_succeed(ray_session: None) -> None:
    d = start_deployment(num_workers=2, num_blocks=64)
    try:
        assert d.cluster is not None and d.redis is not None
        stub = stub_for(d.address)
        prompt = [(i * 3) % 250 + 3 for i in range(48)]
        victim = generate(stub, prompt, worker_id="w0")[0].cache.worker_id
        client = redis.Redis.from_url(d.redis.url)
        wait_for(
            lambda: client.hlen(schema.worker_blocks_key(victim)) == 3, what="w0's blocks in Redis"
        )

        # A second coordinator's mirror, rebuilt from Redis, agrees with the first one.
        mirror = LockedMirror()
        follower = IndexFollower(IndexStore(d.redis.url), mirror, ns="unused")
        follower.rebuild()
        assert d.coordinator is not None
        assert mirror.worker_hashes(WorkerId(victim)) == d.coordinator.mirror.worker_hashes(
            WorkerId(victim)
        )

        ray.kill(d.cluster.actor(victim), no_restart=True)
        wait_for(lambda: not d.cluster.is_alive(victim), what="the coordinator to notice the death")  # type: ignore[union-attr]
        wait_for(lambda: client.hlen(schema.worker_blocks_key(victim)) == 0, what="purge in Redis")
        assert not client.exists(schema.worker_key(victim))
        assert d.coordinator.mirror.num_worker_blocks(WorkerId(victim)) == 0
        assert not stub.Lookup(pb.LookupRequest(token_ids=prompt)).matches

        for k in range(3):
            out = generate(stub, prompt + [k])
            assert out[0].cache.worker_id != victim
        stats = stub.Stats(pb.StatsRequest())
        assert stats.num_live_workers == 1 and stats.num_workers == 2
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompt, worker_id=victim)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        survivor = d.cluster.live_worker_ids()[0]
        ray.kill(d.cluster.actor(survivor), no_restart=True)
        wait_for(lambda: not d.cluster.live_worker_ids(), what="both workers dead")  # type: ignore[union-attr]
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompt)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live worker" in err.value.details()
    finally:
        d.stop()
