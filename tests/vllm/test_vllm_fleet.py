"""kvmesh in front of two real vLLM servers, fed by their own KV events (`make test-vllm`).

Two vLLM instances on a tiny random Llama written here, prefix caching on, KV events over ZMQ;
kvmesh with no workers of its own routes them (`--workers 0 --engine ...`). Shown: a request
sharing a prefix goes back to the engine holding it, and vLLM's own `cached_tokens` confirms
the hit; the index equals what the engines announced; killing one engine purges its entries
and requests keep succeeding on the other.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.engines.engine_fleet import EngineSpec
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from tests.vllm.vllm_server import (
    CPU_BLOCK_SIZE,
    VllmServer,
    has_vllm,
    start_vllm,
    write_tiny_llama,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BS = CPU_BLOCK_SIZE


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    if not has_vllm():  # asked here, not at collection: `make test` deselects these tests
        pytest.skip("needs vLLM's virtualenv (make vllm-venv)")
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [start_vllm(name, model, logs) for name in ("a", "b")]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.kill()


@pytest.fixture(scope="module")
def kvmesh(ray_session: None, model: Path, engines: list[VllmServer]) -> Iterator[Deployment]:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(model=str(model), block_size=BS, port=0),
        num_workers=0,
        engines=tuple(EngineSpec.parse(s.engine_spec) for s in engines),
        http=HttpConfig(port=0),
    )
    deployment = Deployment(config)
    deployment.start()
    yield deployment
    deployment.stop()


def complete(kvmesh: Deployment, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["model"] = httpx.get(f"{kvmesh.http_url}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"{kvmesh.http_url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def kvmesh_hashes(kvmesh: Deployment, prompt: list[int]) -> list[int]:
    assert kvmesh.coordinator is not None
    return [int(h) for h in kvmesh.coordinator.prompts.chain(prompt, "")]


def indexed(kvmesh: Deployment, worker: str) -> set[int]:
    assert kvmesh.coordinator is not None
    mirror: Any = kvmesh.coordinator.mirror
    return {int(h) for h in mirror.worker_hashes(WorkerId(worker))}


def test_both_engines_are_workers_of_kind_vllm(kvmesh: Deployment) -> None:
    assert kvmesh.coordinator is not None
    assert kvmesh.coordinator.registry.routable() == ["a", "b"]
    assert kvmesh.engines is not None and kvmesh.engines.kind("a") == "vllm"


def test_a_shared_prefix_goes_back_to_the_engine_holding_it(kvmesh: Deployment) -> None:
    rng = random.Random(13)
    served: dict[str, int] = {}
    for _ in range(4):
        prefix = [rng.randrange(3, 512) for _ in range(4 * BS + 40)]  # 4 full blocks + a tail
        first = complete(kvmesh, prefix)
        holder = first["kvmesh"]["worker_id"]
        served[holder] = served.get(holder, 0) + 1
        wanted = set(kvmesh_hashes(kvmesh, prefix))
        wait_for(lambda h=holder, w=wanted: w <= indexed(kvmesh, h), what="the holder's events")
        follow_up = complete(kvmesh, prefix + [rng.randrange(3, 512) for _ in range(30)])
        assert follow_up["kvmesh"]["worker_id"] == holder
        # vLLM's own count: the 4 full blocks came from its prefix cache
        assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    assert sum(served.values()) == 4


def test_the_index_equals_what_the_engines_announced(kvmesh: Deployment) -> None:
    assert kvmesh.engines is not None and kvmesh.redis is not None
    store = IndexStore(kvmesh.redis.url)
    for engine in ("a", "b"):
        announced = set(kvmesh.engines.announced()[engine])
        assert announced, f"engine {engine} announced nothing"
        wait_for(lambda e=engine, a=announced: indexed(kvmesh, e) == a, what=f"{engine}'s mirror")
        snapshot = store.snapshot(engine)
        assert snapshot is not None and {int(h) for h, _tier in snapshot.blocks} == announced
    store.close()


def test_killing_an_engine_purges_it_and_requests_keep_succeeding(
    kvmesh: Deployment, engines: list[VllmServer]
) -> None:
    assert kvmesh.coordinator is not None
    victim = next(s for s in engines if indexed(kvmesh, s.name))
    survivor = next(s for s in engines if s is not victim)
    victim.kill()
    rng = random.Random(7)
    for _ in range(4):  # the first may find the dead engine before its health check does
        reply = complete(kvmesh, [rng.randrange(3, 512) for _ in range(2 * BS + 5)])
        assert reply["kvmesh"]["worker_id"] == survivor.name
    wait_for(lambda: not kvmesh.coordinator.registry.is_alive(victim.name), what="death")
    wait_for(lambda: not indexed(kvmesh, victim.name), what="the mirror's purge")
    assert kvmesh.engines is not None and kvmesh.redis is not None
    assert victim.name not in kvmesh.engines.announced()
    store = IndexStore(kvmesh.redis.url)
    wait_for(lambda: store.snapshot(victim.name) is None, what="the purge in Redis")
    store.close()
