"""The admin operations behind the admin RPCs: drain a worker, clear every cache, show the index.

Pure of gRPC (the service maps results to messages, `auth.py` decides who may call them). Drain
works by wrapping the worker backend the coordinator routes over: a drained worker is left out of
`live_worker_ids()`, so the router never picks it again, while the streams it runs finish.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.coordinator.index.mirror import WorkerId

if TYPE_CHECKING:
    from kvmesh.coordinator.cluster.cluster import Cluster
    from kvmesh.coordinator.coordinator import Coordinator
    from kvmesh.workers.engine.worker import RequestOutput, WorkerRequest


class DrainableBackend:
    """The cluster as the coordinator sees it, minus the drained workers.

    Invariant: drained ⊆ cluster.worker_ids(). Everything the coordinator may need besides
    `live_worker_ids` is passed through to the cluster unchanged.
    """

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._drained: set[str] = set()
        self._lock = threading.Lock()

    def live_worker_ids(self) -> list[str]:
        with self._lock:
            drained = set(self._drained)
        return [w for w in self._cluster.live_worker_ids() if w not in drained]

    def worker_ids(self) -> list[str]:
        return self._cluster.worker_ids()

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        return self._cluster.generate(worker_id, request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cluster, name)

    def set_drained(self, worker_id: str, drained: bool) -> None:
        if worker_id not in self._cluster.worker_ids():
            raise ValueError(
                f"unknown worker id {worker_id!r}; workers: {self._cluster.worker_ids()}"
            )
        with self._lock:
            if drained:
                self._drained.add(worker_id)
            else:
                self._drained.discard(worker_id)

    def drained(self) -> list[str]:
        with self._lock:
            return sorted(self._drained)

    def is_drained(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._drained


@dataclass(frozen=True, slots=True)
class IndexView:
    """One worker as this coordinator sees it: its mirror entries and its pool's real content."""

    worker_id: str
    alive: bool
    mirror_hashes: list[int]
    pool_hashes: list[int]
    mirror_generation: int
    mirror_seq: int
    owned: bool
    """This coordinator runs the worker, so `pool_hashes` is its pool (else empty: another
    coordinator's worker, known here only through Redis)."""


class Admin:
    def __init__(
        self, cluster: Cluster, coordinator: Coordinator, backend: DrainableBackend
    ) -> None:
        self.cluster = cluster
        self.coordinator = coordinator
        self.backend = backend

    def drain(self, worker_id: str, *, undrain: bool = False) -> list[str]:
        """Take a worker out of routing (or back in); returns every drained worker."""
        self.backend.set_drained(worker_id, not undrain)
        return self.backend.drained()

    def clear_cache(self) -> dict[str, int]:
        """Every live worker drops its unreferenced cached blocks (and re-publishes its pool
        under a new generation, so every mirror reloads it); returns blocks freed per worker."""
        return {w: int(n) for w, n in self.cluster.call_all("clear_cache").items()}

    def index_views(self) -> list[IndexView]:
        """Mirror and pool of every worker, read one right after the other (under traffic the
        two can differ for a few milliseconds: compare twice before calling it a fault)."""
        pools = self.cluster.call_all("cached_hashes")
        c = self.coordinator
        owned = set(self.cluster.worker_ids())
        with c.mirror_lock:
            known = owned | set(c.mirror.workers())
        views = []
        for w in sorted(known):
            with c.mirror_lock:
                mirror = c.mirror.worker_hashes(WorkerId(w))
                cursor = c.mirror.cursor(WorkerId(w)) or (0, 0)
            views.append(
                IndexView(
                    worker_id=w,
                    alive=self.cluster.is_alive(w) if w in owned else True,
                    mirror_hashes=sorted(int(h) for h in mirror),
                    pool_hashes=sorted(int(h) for h in pools.get(w, [])),
                    mirror_generation=cursor[0],
                    mirror_seq=cursor[1],
                    owned=w in owned,
                )
            )
        return views
