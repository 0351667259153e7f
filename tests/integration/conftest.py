"""Fixtures shared by the integration tests (the session's Ray is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from tests.integration.helpers import end_service_fleet


@pytest.fixture
def service_redis() -> Iterator[RedisServer]:
    """A fresh Redis for a fleet of service workers; the fleet is ended with it (service workers
    outlive their coordinators by design)."""
    server = start_redis_server()
    yield server
    end_service_fleet(server.url)
    server.stop()
