"""A real deployment: embedded Redis server, local Ray workers, gRPC coordinator."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import ray
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import redis_schema as schema
from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PREFIX = [(i * 11) % 250 + 3 for i in range(64)]  # exactly 4 blocks of 16


@pytest.fixture(scope="module")
def deployment(ray_session: None) -> Iterator[Deployment]:
    d = start_deployment(num_workers=2, num_blocks=128)
    yield d
    d.stop()


def held_blocks(stub, tokens: list[int], worker: str) -> int:  # type: ignore[no-untyped-def]
    resp = stub.Lookup(pb.LookupRequest(token_ids=tokens))
    return next((m.matched_blocks for m in resp.matches if m.worker_id == worker), 0)


def test_shared_prefix_is_routed_back_and_reported_cached(deployment: Deployment) -> None:
    stub = stub_for(deployment.address)
    first = generate(stub, PREFIX + [1, 2, 3])
    worker = first[0].cache.worker_id
    assert first[0].cache.cached_tokens == 0
    assert first[0].cache.computed_tokens == 67
    wait_for(lambda: held_blocks(stub, PREFIX, worker) == 4, what="the index to hold the prefix")
    second = generate(stub, PREFIX + [9, 9, 9, 9, 9])
    assert second[0].cache.worker_id == worker
    assert second[0].cache.cached_tokens == 64
    assert second[0].cache.computed_tokens == 5
    assert sum(len(r.token_ids) for r in second) == 4
    assert second[-1].finish_reason == "length"


def test_redis_keys_match_every_worker_pool(deployment: Deployment) -> None:
    stub = stub_for(deployment.address)
    for k in range(4):
        generate(stub, [(i * (k + 5)) % 250 + 3 for i in range(50)], max_tokens=3)
    assert deployment.cluster is not None and deployment.redis is not None
    client = redis.Redis.from_url(deployment.redis.url)
    for w in deployment.cluster.live_worker_ids():
        actor = deployment.cluster.actor(w)

        def matches(actor=actor, w=w) -> bool:  # type: ignore[no-untyped-def]
            pool = {f"{h:016x}" for h in ray.get(actor.cached_hashes.remote())}
            indexed = {h.decode() for h in client.hkeys(schema.worker_blocks_key(w))}
            return pool == indexed

        wait_for(matches, what=f"Redis to match {w}'s pool")
        for h in ray.get(actor.cached_hashes.remote()):
            assert client.hget(schema.worker_blocks_key(w), f"{h:016x}")[:1] == b"0"
        assert ray.get(actor.check_invariants.remote())


def test_bad_input_gets_clear_statuses_and_the_service_keeps_serving(
    deployment: Deployment,
) -> None:
    stub = stub_for(deployment.address)
    cases = [
        (dict(token_ids=[]), 4, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (dict(token_ids=[1, 10**6]), 4, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(token_ids=[1] * 2000), 100, grpc.StatusCode.INVALID_ARGUMENT, "context"),
        (dict(token_ids=[1, 2]), 0, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(token_ids=[1, 2]), 2**31, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (
            dict(token_ids=[1, 2], worker_id="nope"),
            4,
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown worker",
        ),
    ]
    for fields, max_tokens, code, text in cases:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens), **fields)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == code, fields
        assert text in err.value.details(), err.value.details()
    huge = pb.GenerateRequest(
        token_ids=[2**31] * (4 << 20), sampling=pb.SamplingParams(max_tokens=1)
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(huge, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(stub, [5, 6, 7], max_tokens=2)[-1].finish_reason == "length"


def test_forced_placement_and_route_and_stats(deployment: Deployment) -> None:
    stub = stub_for(deployment.address)
    out = generate(stub, PREFIX + [4], worker_id="w1")
    assert out[0].cache.worker_id == "w1"
    route = stub.Route(pb.RouteRequest(token_ids=PREFIX + [4]))
    assert route.worker_id in ("w0", "w1") and len(route.scores) == 2
    short = stub.Route(pb.RouteRequest(token_ids=PREFIX + [4], max_tokens=8))
    assert short.worker_id in ("w0", "w1") and len(short.scores) == 2
    with pytest.raises(grpc.RpcError) as err:
        stub.Route(pb.RouteRequest(token_ids=PREFIX + [4], max_tokens=2**31))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in err.value.details()
    stats = stub.Stats(pb.StatsRequest())
    assert stats.num_live_workers == 2 and stats.redis_connected and stats.num_requests >= 1
    workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
    assert {w.worker_id for w in workers} == {"w0", "w1"}
    assert all(w.alive and w.num_blocks == 128 and w.pid > 0 for w in workers)


def test_text_prompts_use_the_byte_tokenizer(deployment: Deployment) -> None:
    stub = stub_for(deployment.address)
    req = pb.GenerateRequest(
        prompt="hello kvmesh", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    out = list(stub.Generate(req, timeout=30))
    assert out[0].cache.prompt_tokens == len(b"hello kvmesh") + 1  # BOS + bytes
    assert sum(len(r.token_ids) for r in out) == 3


def test_health_and_reflection_answer(deployment: Deployment) -> None:
    channel = grpc.insecure_channel(deployment.address)
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.KVMesh"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "kvmesh.v1.KVMesh" in names and "grpc.health.v1.Health" in names


def test_a_caller_that_falls_behind_gets_the_queued_outputs_joined(
    deployment: Deployment,
) -> None:
    """The worker's one output stream to the coordinator keeps delivering while a request's
    caller is busy; what queued for it comes out as one output, every token in order."""
    import time

    from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest

    assert deployment.cluster is not None
    request = WorkerRequest(
        "slow-reader", tuple(PREFIX[:20]), SamplingConfig(24, ignore_eos=True), origin="test"
    )
    outputs = deployment.cluster.generate("w0", request)
    first = next(outputs)
    time.sleep(1.5)  # the worker runs on to its 24th token meanwhile
    rest = list(outputs)
    tokens = [*first.new_token_ids, *(t for o in rest for t in o.new_token_ids)]
    assert len(tokens) == 24 and rest[-1].finished
    assert len(rest[0].new_token_ids) > 1  # joined: more than one step's token in one output
    assert first.prefill is not None and all(o.prefill is None for o in rest)
