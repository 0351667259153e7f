"""A worker's KV events as numbered batches: `(worker, generation, seq)`.

`seq` counts batches within a generation, from 1; a new generation starts whenever the worker's
cache state must be taken whole (start, ClearCache, a full re-publish after Redis lost events),
so a mirror that sees a gap or a new generation reloads the worker instead of guessing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.proto.events import EventBatch, KVEvent


class EventLog:
    """Invariant: the batches of one generation carry seq 1, 2, 3, ... with no gap."""

    def __init__(self, worker_id: str, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.worker_id = worker_id
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
