"""The one judge of which workers a coordinator may route to.

Fed by everything that learns something about a worker's life: the Ray shell (its actor died),
the index follower (its heartbeat lapsed), admin (drained or back), start-up (added). Each fact
is fanned out from here to whoever keeps state per worker (the mirror and Redis purge, the load
tracker, the routing policy), so they never disagree.

    known ⊇ alive ⊇ routable           routable = alive - drained
    dead:      Ray said the actor died; never alive again under the same id
    lapsed:    the heartbeat in Redis expired; its index entries go (a live worker re-publishes),
               its routing stays up to the Ray shell's verdict
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

Listener = Callable[[str], None]


class WorkerRegistry:
    """Invariants: `_drained`, `_dead` ⊆ `_known`; a worker in `_dead` never leaves it."""

    def __init__(self) -> None:
        self._known: list[str] = []
        self._dead: set[str] = set()
        self._drained: set[str] = set()
        self._routable: tuple[str, ...] | None = None  # cache of routable_ids(); None: stale
        self._lock = threading.Lock()
        self._on_dead: list[Listener] = []
        self._on_lapsed: list[Listener] = []
        self._on_changed: list[Callable[[], None]] = []
        self._adapters: dict[str, frozenset[str]] = {}

    # ---- listeners ----------------------------------------------------------------------------

    def on_dead(self, listener: Listener) -> None:
        """Called once per worker, after it stops being routable."""
        self._on_dead.append(listener)

    def on_changed(self, listener: Callable[[], None]) -> None:
        """Called after anything that can change `routable()` (health checks follow it)."""
        self._on_changed.append(listener)

    def _changed(self) -> None:
        for listener in self._on_changed:
            listener()

    def on_lapsed(self, listener: Listener) -> None:
        """Called whenever a worker's heartbeat is found lapsed (its index entries are stale)."""
        self._on_lapsed.append(listener)

    # ---- facts --------------------------------------------------------------------------------

    def add(self, worker_id: str) -> None:
        with self._lock:
            if worker_id in self._known:
                raise ValueError(f"worker id {worker_id!r} is already registered")
            self._known.append(worker_id)
            self._routable = None
        self._changed()

    def mark_dead(self, worker_id: str, reason: str) -> bool:
        """Take a worker out for good; False if it was unknown or already dead."""
        with self._lock:
            if worker_id not in self._known or worker_id in self._dead:
                return False
            self._dead.add(worker_id)
            self._drained.discard(worker_id)
            self._routable = None
        log.warning(
            "worker %s is gone (%s); removing it from routing and the index", worker_id, reason
        )
        for listener in self._on_dead:
            listener(worker_id)
        self._changed()
        return True

    def report_lapsed(self, worker_id: str) -> None:
        for listener in self._on_lapsed:
            listener(worker_id)

    def set_drained(self, worker_id: str, drained: bool) -> None:
        with self._lock:
            if worker_id not in self._known:
                raise ValueError(f"unknown worker id {worker_id!r}; workers: {sorted(self._known)}")
            if drained:
                if worker_id in self._dead:
                    raise ValueError(f"worker {worker_id!r} is dead; there is nothing to drain")
                self._drained.add(worker_id)
            else:
                self._drained.discard(worker_id)
            self._routable = None
        self._changed()

    def set_adapters(self, worker_id: str, adapters: Iterable[str]) -> None:
        """What a worker reports serving besides the base model (its info, each health check)."""
        with self._lock:
            if worker_id in self._known:
                self._adapters[worker_id] = frozenset(adapters)

    def routable_for(self, adapter: str) -> tuple[str, ...]:
        """Routable workers that serve `adapter` ("" is the base model: every worker, as the
        cached `routable_ids()` tuple)."""
        routable = self.routable_ids()
        if not adapter:
            return routable
        with self._lock:
            return tuple(w for w in routable if adapter in self._adapters.get(w, ()))

    def adapters(self) -> list[str]:
        """Every adapter some live worker reports serving."""
        with self._lock:
            live = [a for w, a in self._adapters.items() if w not in self._dead]
        return sorted(set().union(*live))

    # ---- reads --------------------------------------------------------------------------------

    def known(self) -> list[str]:
        with self._lock:
            return sorted(self._known)

    def alive(self) -> list[str]:
        with self._lock:
            return sorted(w for w in self._known if w not in self._dead)

    def routable(self) -> list[str]:
        return list(self.routable_ids())

    def routable_ids(self) -> tuple[str, ...]:
        """`routable()` as a tuple that stays the same object until the set changes (the
        router caches per-fleet lookups on it)."""
        with self._lock:
            if self._routable is None:
                unroutable = self._dead | self._drained
                self._routable = tuple(sorted(w for w in self._known if w not in unroutable))
            return self._routable

    def drained(self) -> list[str]:
        with self._lock:
            return sorted(self._drained)

    def is_known(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._known

    def is_alive(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._known and worker_id not in self._dead

    def is_drained(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._drained

    def check_invariants(self) -> None:
        with self._lock:
            assert self._drained <= set(self._known) and self._dead <= set(self._known)
            assert not self._drained & self._dead
            assert len(set(self._known)) == len(self._known)
            unroutable = self._dead | self._drained
            routable = tuple(sorted(w for w in self._known if w not in unroutable))
            assert self._routable is None or self._routable == routable, "stale routable cache"
            assert set(self._adapters) <= set(self._known)
