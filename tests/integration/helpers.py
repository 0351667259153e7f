"""Helpers for integration tests: start a real deployment (real Redis, real Ray) and poll it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers.config import WorkerConfig

T = TypeVar("T")
# `KVMESH_TEST_DEVICE=cuda` runs the same suite with CUDA workers (bf16) on a GPU machine.
TEST_DEVICE = os.environ.get("KVMESH_TEST_DEVICE", "cpu")


def start_deployment(
    num_workers: int = 2,
    num_blocks: int = 128,
    *,
    http: HttpConfig | None = None,
    metrics_port: int | None = None,
    host_cache_gb: float = 0.0,
    gpus_per_worker: float = -1.0,
    **coordinator: object,
) -> Deployment:
    worker = WorkerConfig(
        worker_id="template", num_blocks=num_blocks, device=TEST_DEVICE, host_cache_gb=host_cache_gb
    )
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0, **coordinator),  # type: ignore[arg-type]
        num_workers=num_workers,
        worker=worker,
        http=http,
        metrics_port=metrics_port,
        gpus_per_worker=gpus_per_worker,
    )
    deployment = Deployment(config)
    deployment.start()
    return deployment


def stub_for(address: str) -> pb_grpc.KVMeshStub:
    return pb_grpc.KVMeshStub(grpc.insecure_channel(address))


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def generate(
    stub: pb_grpc.KVMeshStub, tokens: list[int], max_tokens: int = 4, **kw: object
) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(
        token_ids=tokens, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw
    )
    return list(stub.Generate(req, timeout=60))


def end_service_fleet(redis_url: str) -> None:
    """Kill every worker registered as a service in this Redis (service workers outlive their
    coordinators by design, so a test ends its fleet itself)."""
    import ray

    from kvmesh.coordinator.index.store import IndexStore

    for service in IndexStore(redis_url).services():
        try:
            ray.kill(ray.get_actor(service.actor_name, namespace=service.ray_namespace))
        except ValueError:
            pass


def holds(stub: pb_grpc.KVMeshStub, tokens: list[int], worker: str, num_blocks: int) -> bool:
    """The coordinator's index says `worker` holds `num_blocks` leading blocks of `tokens`."""
    matches = stub.Lookup(pb.LookupRequest(token_ids=tokens)).matches
    return any(m.worker_id == worker and m.matched_blocks == num_blocks for m in matches)
