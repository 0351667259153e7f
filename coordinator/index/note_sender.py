"""Sends this coordinator's routing decisions to the other replicas, off the routing path.

A replica learns what its peers routed from request notes on the shard streams
(`proto/request_notes.py`). The worker notes a request only once its engine takes it, a step
later; the coordinator that routed it knows at once, so it appends a `RequestTaken` note itself.
Routing only queues the note: this thread appends whatever queued meanwhile in one pipelined
round trip, so peers hear of a route within about one Redis round trip and routing never waits
on Redis. Notes are hints: while Redis is away (or the queue is over `max_queued`) they are
dropped, and the workers' own notes and load reports still reach the peers later.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvmesh.coordinator.index.store import IndexStore, StoreError
from kvmesh.proto.request_notes import NoteBatch

log = logging.getLogger(__name__)

_MAX_PER_ROUND = 512


class NoteSender:
    """Invariant: every queued batch is appended once or counted in `num_dropped`."""

    def __init__(self, store: IndexStore, max_queued: int = 10_000) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.store = store
        self.max_queued = max_queued
        self.num_sent = 0
        self.num_dropped = 0
        self._queue: queue.SimpleQueue[NoteBatch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvmesh-notes", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)

    def send(self, batch: NoteBatch) -> None:
        """Queue `batch` (never blocks)."""
        if self._queue.qsize() >= self.max_queued:
            self.num_dropped += 1
            return
        self._queue.put(batch)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batches = [first]
            while len(batches) < _MAX_PER_ROUND:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._append(batches)
                    return
                batches.append(more)
            self._append(batches)

    def _append(self, batches: list[NoteBatch]) -> None:
        try:
            self.store.append_notes(batches)
        except StoreError as exc:
            if not self._failing:
                log.warning("routing notes: Redis unreachable (%s); peers hear later", exc)
            self._failing = True
            self.num_dropped += len(batches)
            return
        self._failing = False
        self.num_sent += len(batches)
