"""A worker that stops making progress (SIGSTOP) while a stream runs on it: after the stall
timeout it is ended, the stream moves to another worker and completes, and the worker leaves
routing and the index (real Redis, real Ray)."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from kvmesh.client import Client
from kvmesh.proto import redis_schema as schema
from tests.integration.helpers import start_deployment, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]


def test_a_frozen_worker_is_ended_and_its_stream_moves(ray_session: None) -> None:
    d = start_deployment(num_workers=2, num_blocks=128, stall_timeout_s=3.0)
    try:
        assert d.cluster is not None and d.redis is not None
        pid = d.cluster.infos()["w0"].pid
        prompt = [(i * 5) % 250 + 3 for i in range(40)]
        with Client(d.address, timeout_s=120) as client:
            stream = client.stream(prompt, max_tokens=120, worker_id="w0", ignore_eos=True)
            first = next(stream)
            os.kill(pid, signal.SIGSTOP)  # alive to the OS, no progress at all
            try:
                rest = list(stream)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)  # in case it was not ended: never leave it stopped
                except ProcessLookupError:
                    pass
            stats = client.stats()
        chunks = [first, *rest]
        assert sum(len(c.token_ids) for c in chunks) == 120
        assert chunks[-1].finish_reason == "length"
        assert stats.num_migrations >= 1
        assert not d.cluster.is_alive("w0") and d.cluster.is_alive("w1")
        client_redis = redis.Redis.from_url(d.redis.url)
        wait_for(
            lambda: client_redis.hlen(schema.worker_blocks_key("w0")) == 0,
            what="w0 purged from Redis",
        )
    finally:
        d.stop()
