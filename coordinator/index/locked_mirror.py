"""The one shared mirror of a coordinator: an `IndexMirror` and the lock that guards it, owned
together so no caller ever holds one without the other.

The follower writes (events, resyncs, purges); the router, lookups and admin read. Every method
takes the lock for exactly one mirror call: a reader sees a state between two event batches,
never a half-applied one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from kvmesh.coordinator.index.mirror import (
    ApplyResult,
    FleetMatch,
    IndexMirror,
    PrefixMatch,
    WorkerId,
)
from kvmesh.coordinator.index.radix_tree import LinkCheck, TreeNode
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import EventBatch


class NodeView(NamedTuple):
    """One tree node with who holds its block, read under one lock."""

    node: TreeNode
    holders: dict[WorkerId, int]
    """worker -> tier"""


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

    def link(self, links: Iterable[tuple[BlockHash, BlockHash, int]]) -> None:
        """(hash, parent, depth) links read from Redis, for blocks still indexed. A link
        without a depth (0) only fills a gap: it never replaces one the tree has."""
        links = list(links)
        with self._lock:
            m = self._mirror
            held = m.indexed([h for h, _, _ in links])
            for (h, parent, depth), is_held in zip(links, held, strict=True):
                if is_held and (depth or m.tree.parent(h) is None):
                    m.tree.link((h,), parent, depth)

    # ---- reads ----------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        """Per worker, the leading blocks held; counts a hit on the deepest block matched."""
        with self._lock:
            matches = self._mirror.match(hashes)
            if matches:
                deepest = max(m.num_blocks for m in matches.values())
                self._mirror.tree.note_hit(hashes[deepest - 1])
            return matches

    def match_fleet(
        self,
        hashes: Sequence[BlockHash],
        row_of: Mapping[WorkerId, int],
        num_rows: int,
        hash_array: np.ndarray | None = None,
    ) -> FleetMatch:
        """`match` as a fleet's columns (`IndexMirror.match_fleet`); counts the same hit."""
        with self._lock:
            matched = self._mirror.match_fleet(hashes, row_of, num_rows, hash_array)
            if matched.deepest:
                self._mirror.tree.note_hit(hashes[matched.deepest - 1])
            return matched

    def tree_nodes(self, limit: int, *, hottest: bool = False) -> tuple[list[NodeView], int]:
        """At most `limit` nodes, in tree order or the most hit first; and how many there are.
        The tree is walked on a copy, so routing never waits for a walk of the whole index."""
        with self._lock:
            tree = self._mirror.tree.copy()
        nodes = tree.top(limit) if hottest else tree.nodes(limit)
        with self._lock:
            views = [NodeView(n, self._mirror.holders(n.block_hash)) for n in nodes]
        return views, tree.num_nodes

    @property
    def num_tree_nodes(self) -> int:
        with self._lock:
            return self._mirror.tree.num_nodes

    def check_links(self) -> LinkCheck:
        with self._lock:
            tree = self._mirror.tree.copy()
        return tree.check_links()

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
