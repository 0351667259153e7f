"""Fault-test helpers: steady traffic in the background, and "does the index equal the pools"."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import ray

from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc


@dataclass
class TrafficReport:
    sent: int = 0
    ok: int = 0
    failed: int = 0  # the call raised (any status)
    lost: int = 0  # the stream ended without a finish_reason: tokens silently missing
    errors: list[str] = field(default_factory=list)


class Traffic:
    """Generate requests back to back from `num_threads` threads until `stop()`.

    Prompts come from a few families sharing a 2-block prefix, so the index matters to routing.
    """

    def __init__(
        self,
        stub: pb_grpc.KVMeshStub,
        *,
        num_threads: int = 2,
        max_tokens: int = 2,
        metadata: tuple[tuple[str, str], ...] = (),
        seed: int = 0,
    ) -> None:
        self.stub = stub
        self.max_tokens = max_tokens
        self.metadata = metadata
        self.report = TrafficReport()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(seed + i,), daemon=True)
            for i in range(num_threads)
        ]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> TrafficReport:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        return self.report

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            family = rng.randrange(4)
            prompt = [3 + (family * 37 + i * 11) % 300 for i in range(32)]
            prompt += [rng.randrange(3, 300) for _ in range(rng.randrange(1, 24))]
            self._one(prompt)

    def _one(self, prompt: list[int]) -> None:
        request = pb.GenerateRequest(
            token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
        )
        outcome, error = "ok", ""
        try:
            responses = list(self.stub.Generate(request, timeout=60, metadata=self.metadata))
            num_tokens = sum(len(r.token_ids) for r in responses)
            if not responses or not responses[-1].finish_reason or num_tokens != self.max_tokens:
                outcome = "lost"
        except grpc.RpcError as err:
            outcome, error = "failed", f"{err.code().name}: {err.details()}"
        with self._lock:
            r = self.report
            r.sent += 1
            setattr(r, outcome, getattr(r, outcome) + 1)
            if error and len(r.errors) < 20:
                r.errors.append(error)


def index_matches_pools(deployment: Deployment, redis_url: str) -> bool:
    """True when, for every live worker, Redis's set, the coordinator's mirror and the worker's
    pool hold the same hashes (read one after the other: under traffic, retry)."""
    assert deployment.cluster is not None and deployment.coordinator is not None
    store = IndexStore(redis_url)
    try:
        for w in deployment.cluster.live_worker_ids():
            pool = set(ray.get(deployment.cluster.actor(w).cached_hashes.remote(), timeout=10))
            snap = store.snapshot(w)
            in_redis = {int(h) for h, _ in snap.blocks} if snap is not None else set()
            mirrored = set(deployment.coordinator.mirror.worker_hashes(WorkerId(w)))
            if not pool == in_redis == mirrored:
                return False
        return True
    except Exception:  # Redis still away, a worker busy: not consistent yet
        return False
    finally:
        store.close()


def seconds_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started
