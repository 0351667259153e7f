"""A coordinator replica SIGKILLed under load: its workers keep their caches, the other replica
keeps serving, a client given both addresses fails over, and a restarted coordinator rebuilds
its index from Redis and serves (coordinators are real `kvmesh serve` processes joined to the
test's Ray; real Redis)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import Client
from kvmesh.client.errors import KVMeshError
from kvmesh.coordinator.cluster.redis_server import RedisServer
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

PROMPT = [(i * 13) % 250 + 3 for i in range(70)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(gcs: str, redis_url: str, port: int, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "kvmesh.client.cli", "serve", "--ray-address", gcs]
    cmd += ["--redis-url", redis_url, "--port", str(port), "--num-blocks", "128", *extra]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def serving(port: int) -> bool:
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
        return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_a_killed_coordinator_loses_no_cache_and_its_replica_serves(
    ray_session: None, service_redis: RedisServer
) -> None:
    gcs = ray.get_runtime_context().gcs_address
    port_a, port_b = free_port(), free_port()
    a = serve(gcs, service_redis.url, port_a, "--workers", "2")
    b: subprocess.Popen[str] | None = None
    restarted: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: serving(port_a), timeout_s=120, what="coordinator A")
        b = serve(gcs, service_redis.url, port_b, "--attach")
        wait_for(lambda: serving(port_b), timeout_s=120, what="coordinator B (attached)")
        addresses = [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"]
        with Client(addresses, timeout_s=60) as client:
            first = client.generate(PROMPT, max_tokens=2, ignore_eos=True)
            holder = first.worker_id

            # Load through the client while A is killed: every request started after the kill
            # is served (by B), none fails.
            stop, failures, served = threading.Event(), [], []

            def load() -> None:
                while not stop.is_set():
                    try:
                        served.append(client.generate(PROMPT[:40], max_tokens=2, ignore_eos=True))
                    except KVMeshError as exc:
                        failures.append(exc)

            loader = threading.Thread(target=load)
            loader.start()
            wait_for(lambda: len(served) >= 3, timeout_s=60, what="load before the kill")
            a.send_signal(signal.SIGKILL)
            a.wait(timeout=30)
            in_flight_at_kill = len(failures) + 1  # at most the one request A was serving
            wait_for(lambda: len(served) >= 10, timeout_s=60, what="load after the kill")
            stop.set()
            loader.join(timeout=60)
            assert len(failures) <= in_flight_at_kill
            assert client.address == addresses[1]

            # The workers (and their caches) outlived A: the prefix is still a hit, through B.
            again = client.generate(PROMPT, max_tokens=2, ignore_eos=True, worker_id=holder)
            assert again.cached_tokens == 64

        restarted = serve(gcs, service_redis.url, port_a, "--attach")
        wait_for(lambda: serving(port_a), timeout_s=120, what="coordinator A restarted")
        with Client(f"127.0.0.1:{port_a}", timeout_s=60) as client:
            assert {m.worker_id for m in client.lookup(PROMPT).matches} >= {holder}
            result = client.generate(PROMPT, max_tokens=2, ignore_eos=True, worker_id=holder)
            assert result.cached_tokens == 64
    finally:
        for proc in (a, b, restarted):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
