"""External engines routed through a real deployment (Redis, Ray, the OpenAI front door) with
stand-in engines (HTTP + ZMQ, vLLM's formats): the real-vLLM version is tests/vllm/."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.engines.engine_fleet import EngineFleetConfig, EngineSpec
from tests.integration.engine_http_stand_in import StandInOpenAIEngine
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

BS = 16


@pytest.fixture
def engines() -> Iterator[list[StandInOpenAIEngine]]:
    pair = [StandInOpenAIEngine("a", BS), StandInOpenAIEngine("b", BS)]
    yield pair
    for e in pair:
        e.stop()
        e.close()


@pytest.fixture
def kvmesh(ray_session: None, engines: list[StandInOpenAIEngine]) -> Iterator[Deployment]:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(block_size=BS, port=0),
        num_workers=0,
        engines=tuple(EngineSpec.parse(e.spec) for e in engines),
        http=HttpConfig(port=0),
        engine_health=EngineFleetConfig(health_interval_s=0.2, heartbeat_ttl_s=5.0),
    )
    deployment = Deployment(config)
    deployment.start()
    yield deployment
    deployment.stop()


def complete(kvmesh: Deployment, prompt: list[int], *, stream: bool = False) -> dict[str, Any]:
    model = httpx.get(f"{kvmesh.http_url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    reply = httpx.post(f"{kvmesh.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def indexed(kvmesh: Deployment, worker: str) -> int:
    assert kvmesh.coordinator is not None
    return kvmesh.coordinator.indexed_blocks_of(worker)


def test_a_shared_prefix_goes_back_to_the_engine_that_announced_it(kvmesh: Deployment) -> None:
    rng = random.Random(1)
    for _ in range(6):
        prefix = [rng.randrange(3, 200) for _ in range(8 * BS)]
        first = complete(kvmesh, prefix + [5])
        holder = first["kvmesh"]["worker_id"]
        wait_for(lambda h=holder: indexed(kvmesh, h) >= 8, 30.0, what="the holder's events")  # type: ignore[misc]
        again = complete(kvmesh, prefix + [rng.randrange(3, 200) for _ in range(9)])
        assert again["kvmesh"]["worker_id"] == holder
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS
        assert again["kvmesh"]["cached_tokens"] == 8 * BS
    assert kvmesh.engines is not None
    streams = kvmesh.engines.stream_counts()  # what kvmesh_engine_stream_total exports
    assert set(streams) == {"a", "b"} and sum(c["batches"] for c in streams.values()) >= 6
    assert all(c["undecodable"] == 0 and c["resets"] == 0 for c in streams.values())


def test_index_verify_compares_the_mirror_with_what_each_engine_announced(
    kvmesh: Deployment,
) -> None:
    from kvmesh.client import Client

    rng = random.Random(3)
    while not (indexed(kvmesh, "a") and indexed(kvmesh, "b")):
        complete(kvmesh, [rng.randrange(3, 200) for _ in range(3 * BS + 1)])
    with Client(kvmesh.address) as client:
        views = {v.worker_id: v for v in client.index_views().workers}
    for engine in ("a", "b"):
        wait_for(
            lambda e=engine: (
                set(views[e].pool_hashes) == set(views[e].mirror_hashes)  # type: ignore[misc]
                or _refresh(kvmesh, views)
            ),
            30.0,
            what=f"{engine}'s mirror to equal its announced blocks",
        )
        assert views[engine].pool_hashes


def _refresh(kvmesh: Deployment, views: dict[str, Any]) -> bool:
    from kvmesh.client import Client

    with Client(kvmesh.address) as client:
        views.update({v.worker_id: v for v in client.index_views().workers})
    return False


def test_workers_lists_the_engines_with_their_kind(kvmesh: Deployment) -> None:
    from kvmesh.client import Client

    with Client(kvmesh.address) as client:
        workers = {w.worker_id: w for w in client.list_workers()}
    assert set(workers) == {"a", "b"}
    assert {w.kind for w in workers.values()} == {"vllm"} and all(w.alive for w in workers.values())


def test_an_engine_that_stops_answering_is_purged_and_traffic_moves_on(
    kvmesh: Deployment, engines: list[StandInOpenAIEngine]
) -> None:
    assert kvmesh.coordinator is not None
    rng = random.Random(2)
    while not (indexed(kvmesh, "a") and indexed(kvmesh, "b")):
        complete(kvmesh, [rng.randrange(3, 200) for _ in range(4 * BS + 1)])
    engines[0].stop()  # its HTTP server goes away: health checks and proxying fail
    for _ in range(4):
        reply = complete(kvmesh, [rng.randrange(3, 200) for _ in range(2 * BS + 1)])
        assert reply["kvmesh"]["worker_id"] == "b"
    wait_for(lambda: not kvmesh.coordinator.registry.is_alive("a"), 30.0, what="a's death")  # type: ignore[union-attr]
    wait_for(lambda: indexed(kvmesh, "a") == 0, 30.0, what="a's purge")
    assert indexed(kvmesh, "b") > 0
