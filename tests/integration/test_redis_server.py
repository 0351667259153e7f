"""The embedded Redis is locked: loopback only, protected mode, a random password kept in a
mode-0600 file and off the command line. Against a real redis-server."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server

pytestmark = [pytest.mark.redis]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = start_redis_server()
    yield s
    s.stop()


def test_the_embedded_redis_refuses_clients_without_its_random_password(
    server: RedisServer,
) -> None:
    assert len(server.password) >= 32
    other = start_redis_server()
    try:
        assert other.password != server.password
    finally:
        other.stop()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port).get("kvmesh:worker:w0")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, password="guess").ping()
    locked = redis.Redis.from_url(server.url)
    assert locked.ping()
    assert locked.config_get("protected-mode") == {"protected-mode": "yes"}
    assert locked.config_get("bind") == {"bind": "127.0.0.1"}
    assert server.password not in repr(server)


def test_the_password_lives_in_a_private_file_never_on_the_command_line(
    server: RedisServer,
) -> None:
    config = Path(server.workdir) / "redis.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(server.workdir).stat().st_mode) == 0o700
    assert server.password in config.read_text()
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
    assert server.password not in cmdline and str(server.port) in cmdline


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_the_embedded_redis_listens_on_loopback_only(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        start_redis_server(host=host)


def test_an_empty_password_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a password"):
        start_redis_server(password="")
