"""Several Ray nodes on one machine (raylets with their own resources): workers spread over
nodes, a prefix pulled across nodes gives the same tokens, and a lost node loses no request and
is purged (real Redis, real multi-node Ray)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import ray
import redis
from ray.cluster_utils import Cluster as RayNodes

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.proto import redis_schema as schema
from kvmesh.workers.config import WorkerConfig
from tests.integration.helpers import generate, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

PREFIX = [(i * 17) % 250 + 3 for i in range(1024)]  # long enough that a pull beats recompute


@pytest.fixture
def nodes(ray_session: None) -> Iterator[RayNodes]:
    """A head with no CPU for actors and two worker nodes, in place of the session's Ray (which
    is restored afterwards for the tests that follow)."""
    ray.shutdown()
    cluster = _start_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _retry_startup(
            lambda: ray.init(
                address="local",
                num_cpus=8,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            ),
            ray.shutdown,
        )


def _start_nodes() -> RayNodes:
    started: list[RayNodes] = []

    def start() -> RayNodes:  # a fresh cluster each attempt
        started.append(RayNodes())
        started[-1].add_node(num_cpus=0)  # the head: no CPU for actors
        for _ in range(2):
            started[-1].add_node(num_cpus=2)
        return started[-1]

    return _retry_startup(start, lambda: started[-1].shutdown())


T = TypeVar("T")


def _retry_startup(start: Callable[[], T], undo: Callable[[], object], attempts: int = 3) -> T:
    """Ray gives a new raylet a fixed 30 s to register with its GCS; on a loaded two-core machine
    (another Ray still tearing down its workers) one start can miss that, so a start that times
    out is undone and tried again. Any other failure, or the last attempt's, is raised."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as exc:
            undo()
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")


def test_workers_spread_pull_across_nodes_and_survive_a_lost_node(nodes: RayNodes) -> None:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0),
        num_workers=2,
        worker=WorkerConfig(worker_id="template", num_blocks=256, device="cpu"),
    )
    d = Deployment(config)
    d.start()
    try:
        assert d.cluster is not None and d.redis is not None
        infos = d.cluster.infos()
        assert infos["w0"].node != infos["w1"].node  # one worker per node
        stub = stub_for(d.address)

        local = generate(stub, PREFIX + [1, 2], max_tokens=4, worker_id="w0")
        wait_for(
            lambda: d.coordinator is not None and d.coordinator.indexed_blocks_of("w0") >= 64,
            what="w0's prefix in the index",
        )
        pulled = generate(stub, PREFIX + [1, 2], max_tokens=4, worker_id="w1")
        assert pulled[0].cache.pulled_tokens == 1024  # moved across nodes
        assert [t for r in pulled for t in r.token_ids] == [t for r in local for t in r.token_ids]

        # Lose w1's node under traffic: nothing fails (streams move), and w1 is purged.
        w1_node = infos["w1"].node.rsplit("/", 1)[1]  # `host/<Ray node id prefix>`
        victim = next(n for n in nodes.worker_nodes if n.node_id.startswith(w1_node))
        results, failures = [], []

        def traffic() -> None:
            for k in range(12):
                try:
                    results.append(generate(stub, PREFIX[: 64 + k], max_tokens=8))
                except Exception as exc:  # noqa: BLE001 - any failure is what we look for
                    failures.append(exc)

        sender = threading.Thread(target=traffic)
        sender.start()
        wait_for(lambda: len(results) >= 2, timeout_s=60, what="traffic before the loss")
        nodes.remove_node(victim)
        sender.join(timeout=180)
        assert not failures and len(results) == 12
        wait_for(lambda: not d.cluster.is_alive("w1"), timeout_s=30, what="w1 marked dead")  # type: ignore[union-attr]
        client = redis.Redis.from_url(d.redis.url)
        wait_for(
            lambda: client.hlen(schema.worker_blocks_key("w1")) == 0,
            timeout_s=30,
            what="w1 purged from Redis",
        )
    finally:
        d.stop()
