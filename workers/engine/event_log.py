"""A worker's KV events as numbered batches: `(worker, generation, seq)`.

`seq` counts batches within a generation, from 1; a new generation starts whenever the worker's
cache state must be taken whole (start, ClearCache, a full re-publish after Redis lost events),
so a mirror that sees a gap or a new generation reloads the worker instead of guessing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.proto.events import TIER_HOST, AllCleared, BlockStored, EventBatch, KVEvent

if TYPE_CHECKING:
    from kvmesh.workers.kv.block_pool import BlockPool
    from kvmesh.workers.kv.host_pool import HostPool


class EventLog:
    """The events of a worker's device pool and host pool (when it has one), in batches.

    Invariant: the batches of one generation carry seq 1, 2, 3, ... with no gap."""

    def __init__(
        self,
        worker_id: str,
        pool: BlockPool,
        host_pool: HostPool | None,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.host_pool = host_pool
        self._wall_ns = wall_ns
        self.generation = wall_ns()
        self.seq = 0

    def new_generation(self) -> None:
        self.generation = max(self.generation + 1, self._wall_ns())
        self.seq = 0

    def next_batch(self, events: list[KVEvent]) -> EventBatch:
        self.seq += 1
        now_ms = self._wall_ns() // 1_000_000
        return EventBatch(self.worker_id, self.generation, self.seq, tuple(events), now_ms)

    def drain(self) -> EventBatch | None:
        """What both pools did since the last batch; None when nothing happened."""
        events = self.pool.drain_events()
        if self.host_pool is not None:
            events += self.host_pool.drain_events()
        if not events:
            return None
        return self.next_batch(events)

    def full_state(self) -> EventBatch:
        """Everything the pools hold, under a new generation (after Redis lost our events)."""
        self.pool.drain_events()
        events: list[KVEvent] = [AllCleared()]
        if self.host_pool is not None:
            self.host_pool.drain_events()
            events.append(BlockStored(tuple(self.host_pool.cached_hashes()), TIER_HOST))
        events += self.pool.stored_events()
        self.new_generation()
        return self.next_batch(events)
