"""Prices and runs pulls for the coordinator: link bandwidth by type, kept honest by every pull.

The router asks `price(source, target, tokens)` while choosing; the coordinator calls `execute`
for the chosen worker's plan before the request starts. A failed pull costs nothing but time: the
worker recomputes what did not arrive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.pull_planner import PullPlan
from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.transfer.links import LinkTable, LinkType, link_type

log = logging.getLogger(__name__)


class PullBackend(Protocol):
    def pull(self, target: str, source: str, hashes: list[int], parent: int) -> int: ...


class TransferManager:
    """Invariant: the link table only ever holds positive bandwidths (LinkTable checks)."""

    def __init__(
        self,
        backend: PullBackend,
        worker_info: Callable[[str], dict[str, Any]],
        kv_bytes_per_token: int,
        block_size: int,
        links: LinkTable | None = None,
    ) -> None:
        self.backend = backend
        self.worker_info = worker_info
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_size = block_size
        self.links = links or LinkTable()
        self._lock = threading.Lock()
        self.num_pulls = 0
        self.num_failed_pulls = 0
        self.pulled_tokens = 0

    def link(self, source: str, target: str) -> LinkType:
        s, t = self.worker_info(source), self.worker_info(target)
        return link_type(
            str(s.get("node", "")), str(s.get("device", "")),
            str(t.get("node", "")), str(t.get("device", "")),
        )  # fmt: skip

    def price(self, source: WorkerId, target: WorkerId, num_tokens: int) -> float:
        with self._lock:
            return self.links.transfer_ms(
                self.link(source, target), num_tokens * self.kv_bytes_per_token
            )

    def calibrate(self, source: str, target: str, bytes_per_ms: float, latency_ms: float) -> None:
        with self._lock:
            self.links.set(self.link(source, target), bytes_per_ms, latency_ms)

    def execute(
        self, plan: PullPlan, target: WorkerId, hashes: tuple[BlockHash, ...], root: BlockHash
    ) -> int:
        """Run the pull; returns the prompt tokens whose KV the target now holds from it."""
        run = list(hashes[plan.from_block : plan.num_blocks])
        parent = hashes[plan.from_block - 1] if plan.from_block else root
        started = time.perf_counter()
        held = self.backend.pull(target, plan.source, [int(h) for h in run], int(parent))
        elapsed_ms = (time.perf_counter() - started) * 1e3
        with self._lock:
            self.num_pulls += 1
            if held == 0:
                self.num_failed_pulls += 1
                return 0
            moved = held * self.block_size * self.kv_bytes_per_token
            self.links.observe(self.link(plan.source, target), moved, elapsed_ms)
            self.pulled_tokens += held * self.block_size
        return held * self.block_size
