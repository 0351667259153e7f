"""The admin operations behind the admin RPCs: drain a worker, clear every cache, show the index.

Pure of gRPC (the service maps results to messages, `auth.py` decides who may call them) and of
Ray (the fleet is reached through the `Fleet` protocol, which the Ray shell implements). Drain is
a fact told to the worker registry: a drained worker is not routable, while its streams finish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.index.locked_mirror import LockedMirror, NodeView
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.radix_tree import LinkCheck
from kvmesh.workers.contract.replies import WorkerInfo

if TYPE_CHECKING:
    from kvmesh.coordinator.coordinator import Coordinator


class FleetControl(Protocol):
    """Growing and shrinking the fleet (`cluster/fleet.py`)."""

    def scale_to(self, num_workers: int, drain_timeout_s: float) -> tuple[list[str], list[str]]: ...


class Fleet(Protocol):
    """What the service and admin need from the workers' shell (`cluster/cluster.py`)."""

    registry: WorkerRegistry

    def infos(self, timeout_s: float = 2.0) -> dict[str, WorkerInfo]: ...
    def latest_info(self, worker_id: str) -> WorkerInfo | None: ...
    def call_all(self, method: str, *args: Any, timeout_s: float = 30.0) -> dict[str, Any]: ...


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


@dataclass(frozen=True, slots=True)
class CacheReset:
    """What ClearCache did."""

    cache_epoch: int
    """The epoch every worker and this coordinator now hash under."""
    num_freed_blocks: dict[str, int]
    """worker -> cached blocks dropped."""


MAX_TREE_NODES = 100_000


class Admin:
    def __init__(
        self,
        fleet: Fleet,
        coordinator: Coordinator,
        mirror: LockedMirror,
        control: FleetControl | None = None,
        *,
        external_pools: Callable[[], dict[str, list[int]]] = dict,
        bump_cache_epoch: Callable[[], int] | None = None,
    ) -> None:
        self.external_pools = external_pools
        """Block hashes each external engine announced (its "pool", as kvmesh knows it)."""
        self.cluster = fleet
        self.coordinator = coordinator
        self.mirror = mirror
        self.registry = fleet.registry
        self.control = control
        self._bump_cache_epoch = bump_cache_epoch or (lambda: coordinator.prompts.cache_epoch() + 1)

    def scale(self, num_workers: int, drain_timeout_s: float) -> tuple[list[str], list[str]]:
        """Grow or shrink the fleet; returns (started, stopped) worker ids."""
        if self.control is None:
            raise ValueError("this coordinator cannot start or stop workers")
        return self.control.scale_to(num_workers, drain_timeout_s)

    def drain(self, worker_id: str, *, undrain: bool = False) -> list[str]:
        """Take a worker out of routing (or back in); returns every drained worker."""
        self.registry.set_drained(worker_id, not undrain)
        return self.registry.drained()

    def clear_cache(self) -> CacheReset:
        """A true reset: the fleet moves to a new cache epoch (in Redis, so every coordinator
        hashes under it), every live worker drops its unreferenced cached blocks, moves to the
        epoch and re-publishes its pool under a new generation. Blocks running requests still
        hold keep their old-epoch hashes, which nothing hashed from now on can match."""
        epoch = self._bump_cache_epoch()
        freed = self.cluster.call_all("clear_cache", epoch)
        return CacheReset(epoch, {w: int(n) for w, n in freed.items()})

    def tree(self, max_nodes: int, *, hottest: bool = False) -> tuple[list[NodeView], int]:
        """The mirror's prefix tree (tree order, or most hit first) and its size."""
        if not 0 <= max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [0, {MAX_TREE_NODES}], got {max_nodes}")
        return self.mirror.tree_nodes(max_nodes or 1000, hottest=hottest)

    def check_links(self) -> LinkCheck:
        return self.mirror.check_links()

    def index_views(self) -> list[IndexView]:
        """Mirror and pool of every worker, read one right after the other (under traffic the
        two can differ for a few milliseconds: compare twice before calling it a fault)."""
        pools = self.cluster.call_all("cached_hashes")
        pools.update(self.external_pools())
        mirror = self.mirror
        owned = set(self.registry.known())
        known = owned | set(mirror.workers())
        views = []
        for w in sorted(known):
            hashes = mirror.worker_hashes(WorkerId(w))
            cursor = mirror.cursor(WorkerId(w)) or (0, 0)
            views.append(
                IndexView(
                    worker_id=w,
                    alive=self.registry.is_alive(w) if w in owned else True,
                    mirror_hashes=sorted(int(h) for h in hashes),
                    pool_hashes=sorted(int(h) for h in pools.get(w, [])),
                    mirror_generation=cursor[0],
                    mirror_seq=cursor[1],
                    owned=w in owned,
                )
            )
        return views
