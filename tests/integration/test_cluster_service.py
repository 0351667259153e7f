"""kvmesh as a cluster service: workers outlive coordinators, replicas share one fleet with
distinct ids, dead workers are replaced, the fleet scales (draining first), health follows the
fleet, and start-up errors are one clear line (real Redis, real Ray)."""

from __future__ import annotations

import threading

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import Client
from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.cluster.fleet import RAY_NAMESPACE, PlacementError
from kvmesh.coordinator.cluster.redis_server import RedisServer
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.workers.config import WorkerConfig
from tests.integration.helpers import TEST_DEVICE, generate, holds, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PROMPT = [(i * 11) % 250 + 3 for i in range(70)]  # 4 full blocks


def service(redis_url: str, num_workers: int = 2, **kw: object) -> Deployment:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0, redis_url=redis_url),
        num_workers=num_workers,
        worker=WorkerConfig(worker_id="template", num_blocks=128, device=TEST_DEVICE),
        own_workers=False,
        fleet_poll_s=0.2,
        **kw,  # type: ignore[arg-type]
    )
    deployment = Deployment(config)
    deployment.start()
    return deployment


def alive(d: Deployment) -> list[str]:
    assert d.cluster is not None
    return d.cluster.registry.alive()


def test_workers_outlive_their_coordinator_and_a_new_one_attaches(
    ray_session: None, service_redis: RedisServer
) -> None:
    first = service(service_redis.url)
    try:
        out = generate(stub_for(first.address), PROMPT, worker_id="w0")
        assert out[0].cache.computed_tokens == len(PROMPT)
    finally:
        first.stop()  # the coordinator goes; its workers and their caches stay

    second = service(service_redis.url, attach=True)
    try:
        assert alive(second) == ["w0", "w1"]
        stub = stub_for(second.address)
        wait_for(
            lambda: holds(stub, PROMPT, "w0", 4),
            what="the new coordinator's mirror, rebuilt from Redis",
        )
        again = generate(stub, PROMPT)
        assert again[0].cache.worker_id == "w0" and again[0].cache.cached_tokens == 64
    finally:
        second.stop()


def test_two_coordinators_share_one_fleet_with_distinct_ids(
    ray_session: None, service_redis: RedisServer
) -> None:
    a = service(service_redis.url, num_workers=2)
    b = service(service_redis.url, num_workers=3)  # attaches to w0, w1 and starts one more
    try:
        assert alive(b) == ["w0", "w1", "w2"]
        wait_for(lambda: alive(a) == ["w0", "w1", "w2"], what="the first coordinator to attach w2")
        # A prefix computed through one coordinator is a hit through the other.
        generate(stub_for(a.address), PROMPT, worker_id="w2")
        stub_b = stub_for(b.address)
        wait_for(
            lambda: holds(stub_b, PROMPT, "w2", 4),
            what="w2's blocks in the second coordinator's mirror",
        )
        assert generate(stub_b, PROMPT)[0].cache.worker_id == "w2"
    finally:
        a.stop()
        b.stop()


def test_each_replica_counts_the_requests_the_other_routes(
    ray_session: None, service_redis: RedisServer
) -> None:
    a = service(service_redis.url)
    b = service(service_redis.url, attach=True)
    try:
        generate(stub_for(a.address), PROMPT, max_tokens=8, worker_id="w1")
        peers = b.coordinator.peer_routes
        wait_for(lambda: peers.num_taken == 1, what="b to hear of a's request")
        wait_for(lambda: len(peers) == 0, what="b to hear that it finished")
        assert b.coordinator.load.num_running(WorkerId("w1")) == 0
        assert a.coordinator.peer_routes.num_taken == 0  # a's own notes come back to a: skipped
        # Told twice that it was taken (a at once, w1 from its engine), then once each after.
        notes = [
            (type(n).__name__, e.notes.worker_id, n.request_id)
            for e in IndexStore(service_redis.url).read_stream({}, None, count=10_000)
            if e.notes is not None
            for n in e.notes.notes
        ]
        assert len({rid for _, _, rid in notes}) == 1  # the one request sent
        assert sorted((kind, worker) for kind, worker, _ in notes) == [
            ("RequestFinished", "w1"),
            ("RequestPrefilled", "w1"),
            ("RequestTaken", "w1"),
            ("RequestTaken", "w1"),
        ]
    finally:
        a.stop()
        b.stop()


def test_a_dead_worker_is_replaced_under_a_new_id(
    ray_session: None, service_redis: RedisServer
) -> None:
    d = service(service_redis.url, replace_dead_workers=True)
    try:
        assert d.cluster is not None
        ray.kill(d.cluster.actor("w0"), no_restart=True)
        wait_for(lambda: alive(d) == ["w1", "w2"], timeout_s=60, what="w0 replaced by w2")
        store = IndexStore(service_redis.url)
        assert sorted(s.worker_id for s in store.services()) == ["w1", "w2"]
        out = generate(stub_for(d.address), PROMPT, worker_id="w2")
        assert out[-1].finish_reason == "length"
    finally:
        d.stop()


def test_scale_grows_then_drains_a_worker_before_stopping_it(
    ray_session: None, service_redis: RedisServer
) -> None:
    d = service(service_redis.url)
    try:
        with Client(d.address, timeout_s=120) as client:
            grown = client.scale(3)
            assert grown.started_worker_ids == ["w2"] and grown.num_workers == 3
            # A long stream on the worker that will leave, then shrink while it runs.
            stream = client.stream(PROMPT, max_tokens=60, worker_id="w2", ignore_eos=True)
            first = next(stream)
            shrunk: list[object] = []
            scaler = threading.Thread(target=lambda: shrunk.append(client.scale(2)))
            scaler.start()
            rest = list(stream)
            scaler.join(timeout=120)
            migrations = client.stats().num_migrations
        tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
        assert tokens == 60 and rest[-1].finish_reason == "length"
        assert migrations == 0  # the stream finished on w2: drained, not cut and moved
        assert shrunk and shrunk[0].stopped_worker_ids == ["w2"]  # type: ignore[attr-defined]
        assert alive(d) == ["w0", "w1"]
        assert [s.worker_id for s in IndexStore(service_redis.url).services()] == ["w0", "w1"]
    finally:
        d.stop()


def test_health_is_not_serving_while_no_worker_can_take_a_request(
    ray_session: None, service_redis: RedisServer
) -> None:
    d = service(service_redis.url)
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(d.address))
        ask = lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status  # noqa: E731
        assert ask() == health_pb2.HealthCheckResponse.SERVING
        with Client(d.address) as client:
            client.drain("w0")
            client.drain("w1")
            assert ask() == health_pb2.HealthCheckResponse.NOT_SERVING
            client.drain("w1", undrain=True)
        assert ask() == health_pb2.HealthCheckResponse.SERVING
    finally:
        d.stop()


def test_a_taken_port_and_an_unplaceable_fleet_are_clear_errors(
    ray_session: None, service_redis: RedisServer
) -> None:
    d = service(service_redis.url, num_workers=1)
    try:
        taken = DeploymentConfig(
            coordinator=CoordinatorConfig(port=d.port, redis_url=service_redis.url),
            own_workers=False,
            attach=True,
        )
        with pytest.raises(OSError, match=f"port {d.port} .* already in use"):
            Deployment(taken).start()
    finally:
        d.stop()
    with pytest.raises(PlacementError, match=r"cannot place 6\d workers .* the Ray cluster has"):
        service(service_redis.url, num_workers=64)
    assert RAY_NAMESPACE == "kvmesh"
