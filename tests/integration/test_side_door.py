"""A coordinator on its worker's node reaches it through the worker's side door (a Unix socket)
instead of Ray: the same tokens as over Ray, a killed worker ends the requests waiting on it
with WorkerDied, and a caller or a coordinator that goes away aborts its requests on the worker
(real Ray, real sockets)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.contract import WorkerDied
from kvmesh.workers.contract.replies import RequestRejected, WorkerInfo
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from tests.integration.helpers import start_deployment, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PROMPT = tuple((i * 11) % 250 + 3 for i in range(40))
LONG = 1900
"""Tokens a request would run to if nothing stopped it (the pool holds 128 x 16)."""


@pytest.fixture
def deployment(ray_session: None) -> Iterator[Deployment]:
    d = start_deployment(num_workers=1, num_blocks=128)
    yield d
    d.stop()


def request(rid: str, max_tokens: int, prompt: tuple[int, ...] = PROMPT) -> WorkerRequest:
    return WorkerRequest(rid, prompt, SamplingConfig(max_tokens, ignore_eos=True))


def tokens(cluster: Cluster, req: WorkerRequest) -> list[int]:
    return [t for out in cluster.generate("w0", req) for t in out.new_token_ids]


def second_cluster(d: Deployment, side_door: bool = False) -> Cluster:
    """A second coordinator's view of the same worker (over Ray only, unless `side_door`)."""
    assert d.cluster is not None
    cluster = Cluster(WorkerRegistry(), side_door=side_door)
    cluster.add_worker(d.cluster.config("w0"), d.cluster.actor("w0"))
    return cluster


def worker_info(actor: Any) -> WorkerInfo:
    info: WorkerInfo = ray.get(actor.info.remote(), timeout=10)
    return info


def idle(actor: Any) -> bool:
    info = worker_info(actor)
    return info.num_running + info.num_waiting == 0


def test_the_side_door_gives_the_same_tokens_as_ray(deployment: Deployment) -> None:
    assert deployment.cluster is not None
    over_ray = second_cluster(deployment)
    try:
        for i, prompt in enumerate((PROMPT, PROMPT[::-1] + PROMPT)):
            via_door = tokens(deployment.cluster, request(f"door-{i}", 24, prompt))
            via_ray = tokens(over_ray, request(f"ray-{i}", 24, prompt))
            assert len(via_door) == 24 and via_door == via_ray
        assert deployment.cluster.via_side_door("w0")
        assert not over_ray.via_side_door("w0")
    finally:
        over_ray.stop(kill_workers=False)


def test_a_door_that_does_not_open_falls_back_to_ray(deployment: Deployment) -> None:
    assert deployment.cluster is not None
    actor = deployment.cluster.actor("w0")
    _, path = ray.get(actor.request_channel_address.remote(), timeout=10)
    os.unlink(path)  # the socket file is gone: connecting fails
    other = second_cluster(deployment, side_door=True)
    try:
        assert tokens(other, request("fallback", 8)) == tokens(
            deployment.cluster, request("reference", 8)
        )
        assert not other.via_side_door("w0")
    finally:
        other.stop(kill_workers=False)


def test_a_rejected_request_raises_through_the_side_door(deployment: Deployment) -> None:
    assert deployment.cluster is not None
    tokens(deployment.cluster, request("warm", 1))
    assert deployment.cluster.via_side_door("w0")
    with pytest.raises(RequestRejected):
        tokens(deployment.cluster, request("too-long", 4, tuple(range(3, 3000))))


def test_closing_a_stream_or_its_coordinator_aborts_on_the_worker(deployment: Deployment) -> None:
    cluster = deployment.cluster
    assert cluster is not None
    actor = cluster.actor("w0")
    stream = cluster.generate("w0", request("left", LONG))
    next(stream)
    assert cluster.via_side_door("w0")
    stream.close()  # the caller went away
    wait_for(lambda: idle(actor), what="the abandoned request aborted")
    orphan = cluster.generate("w0", request("orphan", LONG, PROMPT[::-1]))
    next(orphan)
    cluster.forget_actor("w0")  # this coordinator's stream to the worker closes
    wait_for(lambda: idle(actor), what="the orphaned request aborted")
    generated = worker_info(actor).counters.generated_tokens
    assert generated < LONG, generated  # neither request ran to its end


def test_a_killed_worker_ends_its_waiting_requests_with_worker_died(
    deployment: Deployment,
) -> None:
    cluster = deployment.cluster
    assert cluster is not None
    stream = cluster.generate("w0", request("doomed", LONG))
    next(stream)
    assert cluster.via_side_door("w0")
    os.kill(worker_info(cluster.actor("w0")).pid, signal.SIGKILL)
    with pytest.raises(WorkerDied):
        for _ in stream:
            pass
    wait_for(lambda: not cluster.is_alive("w0"), what="w0 marked dead")
