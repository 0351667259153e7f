"""A worker's keep-alive (sent while one engine iteration runs long) refreshes its liveness key
and nothing else, on a real Redis."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.proto import redis_schema as schema
from kvmesh.workers.engine.event_publisher import EventPublisher

NS = "00000000000000aa"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = start_redis_server()
    yield s
    s.stop()


def test_keep_alive_refreshes_only_the_liveness_key(server: RedisServer) -> None:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    publisher = EventPublisher(server.url, NS, "w7")
    assert publisher.keep_alive(3000)
    alive = schema.worker_alive_key("w7")
    assert client.get(alive) == b"1"
    assert 0 < client.pttl(alive) <= 3000
    # No worker record, no membership: a purged worker is not revived by a keep-alive.
    assert not client.exists(schema.worker_key("w7"))
    assert not client.sismember(schema.workers_key(schema.index_shard("w7")), "w7")
    assert publisher.keep_alive(8000)
    assert 3000 < client.pttl(alive) <= 8000
    publisher.close()


def test_keep_alive_without_redis_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    publisher = EventPublisher(f"redis://127.0.0.1:{port}/0", NS, "w7", socket_timeout_s=0.5)
    assert not publisher.keep_alive(3000)
