"""The one shared mirror of a coordinator: an `IndexMirror` and the lock that guards it, owned
together so no caller ever holds one without the other.

The follower writes (events, resyncs, purges); the router, lookups and admin read. Every method
takes the lock for exactly one mirror call: a reader sees a state between two event batches,
never a half-applied one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvmesh.coordinator.index.mirror import ApplyResult, IndexMirror, PrefixMatch, WorkerId
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import EventBatch


class LockedMirror:
    """Invariant: `_mirror` is only touched with `_lock` held."""

    def __init__(self, mirror: IndexMirror | None = None) -> None:
        self._mirror = mirror if mirror is not None else IndexMirror()
        self._lock = threading.Lock()

    # ---- writes (the follower) ------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> ApplyResult:
        with self._lock:
            return self._mirror.apply(batch)

    def load_worker(
        self, worker: WorkerId, generation: int, seq: int, blocks: Iterable[tuple[BlockHash, int]]
    ) -> None:
        with self._lock:
            self._mirror.load_worker(worker, generation, seq, blocks)

    def remove_worker(self, worker: WorkerId) -> int:
        with self._lock:
            return self._mirror.remove_worker(worker)

    # ---- reads ----------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        with self._lock:
            return self._mirror.match(hashes)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return self._mirror.num_blocks

    @property
    def num_events_applied(self) -> int:
        with self._lock:
            return self._mirror.num_events_applied

    def workers(self) -> list[WorkerId]:
        with self._lock:
            return self._mirror.workers()

    def num_worker_blocks(self, worker: WorkerId) -> int:
        with self._lock:
            return self._mirror.num_worker_blocks(worker)

    def worker_hashes(self, worker: WorkerId) -> dict[BlockHash, int]:
        with self._lock:
            return dict(self._mirror.worker_hashes(worker))

    def cursor(self, worker: WorkerId) -> tuple[int, int] | None:
        with self._lock:
            return self._mirror.cursor(worker)

    def check_invariants(self) -> None:
        with self._lock:
            self._mirror.check_invariants()
