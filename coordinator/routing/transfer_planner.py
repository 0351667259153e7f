"""Prices pulls for the router, names how each would travel, and learns from the pulls workers
report. It moves nothing: the worker that serves a request runs its pull (see `workers/actor.py`)
and reports what it pulled and how long it took in the request's `PrefillFacts`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.links import LinkTable, LinkType, link_type
from kvmesh.workers.contract.replies import PrefillFacts, WorkerInfo
from kvmesh.workers.contract.requests import Transport


class PullPricing(Protocol):
    """What the coordinator needs to plan pulls: a price, a transport, and feedback. The live
    system's is `TransferPlanner`; the simulator prices with its cost model."""

    num_pulls: int
    num_failed_pulls: int
    uniform_price: bool
    """True if `price` depends on the tokens moved alone, whatever the pair (one link for all):
    the router then prices a pull once per distinct match, not once per worker."""

    def price(self, source: WorkerId, target: WorkerId, num_tokens: int) -> float: ...
    def price_many(
        self, source: WorkerId, targets: Sequence[WorkerId], num_tokens: np.ndarray
    ) -> np.ndarray: ...
    def transport(self, source: str, target: str) -> Transport: ...
    def observe(self, source: str, target: str, facts: PrefillFacts) -> None: ...


class TransferPlanner:
    """Invariant: the link table only ever holds positive bandwidths (LinkTable checks)."""

    uniform_price = False  # the link depends on the pair's nodes and devices

    def __init__(
        self,
        worker_info: Callable[[str], WorkerInfo | None],
        kv_bytes_per_token: int,
        block_size: int,
        links: LinkTable | None = None,
        nccl_members: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self.worker_info = worker_info
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_size = block_size
        self.links = links or LinkTable()
        self.nccl_members = nccl_members
        self._lock = threading.Lock()
        self.num_pulls = 0
        self.num_failed_pulls = 0
        self.pulled_tokens = 0

    def link(self, source: str, target: str) -> LinkType:
        s, t = self.worker_info(source), self.worker_info(target)
        return link_type(
            s.node if s else "", s.device if s else "",
            t.node if t else "", t.device if t else "",
        )  # fmt: skip

    def transport(self, source: str, target: str) -> Transport:
        """Same GPU: CUDA IPC; two GPUs in the NCCL group: NCCL; anything else: object store."""
        link = self.link(source, target)
        info = self.worker_info(source)
        if link is LinkType.SAME_DEVICE and info is not None and info.device.startswith("cuda"):
            return Transport.CUDA_IPC
        members = self.nccl_members()
        if source in members and target in members:
            return Transport.NCCL
        return Transport.OBJECT_STORE

    def price(self, source: WorkerId, target: WorkerId, num_tokens: int) -> float:
        with self._lock:
            return self.links.transfer_ms(
                self.link(source, target), num_tokens * self.kv_bytes_per_token
            )

    def price_many(
        self, source: WorkerId, targets: Sequence[WorkerId], num_tokens: np.ndarray
    ) -> np.ndarray:
        """`price` of each target (the router's vectorised path): a lookup per target for its
        link type, then the arithmetic of `LinkTable.transfer_ms` over arrays."""
        with self._lock:
            links = [self.link(source, t) for t in targets]
            latency = np.array([self.links.latency_ms[k] for k in links], dtype=np.float64)
            bandwidth = np.array([self.links.bytes_per_ms[k] for k in links], dtype=np.float64)
        num_bytes = np.asarray(num_tokens, dtype=np.int64) * self.kv_bytes_per_token
        return latency + num_bytes / bandwidth

    def calibrate(self, source: str, target: str, bytes_per_ms: float, latency_ms: float) -> None:
        with self._lock:
            self.links.set(self.link(source, target), bytes_per_ms, latency_ms)

    def observe(self, source: str, target: str, facts: PrefillFacts) -> None:
        """Count a planned pull and fold its measured speed into the link's price."""
        with self._lock:
            self.num_pulls += 1
            if facts.pulled_tokens == 0:
                self.num_failed_pulls += 1
                return
            self.pulled_tokens += facts.pulled_tokens
            if facts.pull_bytes and facts.pull_ms > 0:
                self.links.observe(self.link(source, target), facts.pull_bytes, facts.pull_ms)
