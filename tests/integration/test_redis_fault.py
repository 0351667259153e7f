"""Redis dies (SIGKILL) under traffic and comes back empty on the same port: no request fails,
routing falls back to load only and says so, and the index equals the pools again within 5 s.

The Redis here requires a password (`requirepass`), so the same run checks that password URLs
work end to end and that the password never reaches a log line. `pytest -s` prints the figures
quoted in docs/reliability.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.proto import kvmesh_pb2 as pb
from tests.integration.fault_helpers import Traffic, index_matches_pools, seconds_until
from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PASSWORD = "pw-7c1e-never-logged"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = start_redis_server(password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def deployment(ray_session: None, redis_server: RedisServer) -> Iterator[Deployment]:
    d = start_deployment(num_workers=2, num_blocks=96, redis_url=redis_server.url)
    yield d
    d.stop()


def test_redis_killed_and_restarted_empty_costs_no_request(
    deployment: Deployment, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stub = stub_for(deployment.address)
    url = redis_server.url
    with Traffic(stub, num_threads=2) as traffic:
        seconds_until(lambda: traffic.report.ok >= 10, 60, "warm-up traffic")
        seconds_until(lambda: index_matches_pools(deployment, url), 10, "a consistent index")

        redis_server.kill()
        killed = time.monotonic()
        wait_for(lambda: not stub.Stats(pb.StatsRequest()).redis_connected, what="Redis loss")
        stats = stub.Stats(pb.StatsRequest())
        assert stats.routing == "load_only"
        detected_s = time.monotonic() - killed
        sent_before = traffic.report.sent
        time.sleep(1.5)  # requests keep flowing with Redis away
        assert traffic.report.sent > sent_before

        redis_server.restart()  # empty: nothing persisted
        recover_s = seconds_until(
            lambda: index_matches_pools(deployment, url), 15, "the index to equal the pools"
        )
        assert stub.Stats(pb.StatsRequest()).routing == "cache_aware"
        time.sleep(0.5)  # and traffic goes on after the recovery
    report = traffic.report
    print(
        f"\nFAULT redis-kill-restart: sent={report.sent} failed={report.failed}"
        f" lost={report.lost} detected_s={detected_s:.2f} recover_s={recover_s:.2f}"
    )
    assert report.failed == 0 and report.lost == 0, report.errors
    assert PASSWORD not in caplog.text
    assert PASSWORD not in repr(deployment.config)


def test_an_embedded_redis_that_dies_is_restarted_and_the_index_rebuilt(
    ray_session: None,
) -> None:
    d = start_deployment(num_workers=2, num_blocks=96)  # no redis_url: the embedded Redis
    try:
        assert d.redis is not None and d.redis_keeper is not None
        stub = stub_for(d.address)
        generate(stub, [(i * 3) % 250 + 3 for i in range(70)], max_tokens=2)
        url = d.redis.url
        seconds_until(lambda: index_matches_pools(d, url), 15, "a consistent index")
        d.redis.kill()
        wait_for(lambda: d.redis_keeper.num_restarts == 1, timeout_s=15, what="the restart")  # type: ignore[union-attr]
        seconds_until(lambda: index_matches_pools(d, url), 30, "the index rebuilt")
        wait_for(lambda: stub.Stats(pb.StatsRequest()).routing == "cache_aware", what="routing")
    finally:
        d.stop()
