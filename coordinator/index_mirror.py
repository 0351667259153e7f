"""In-memory mirror of the global prefix index: which worker holds which block, on which tier.

The hot path (routing) reads only this mirror and never waits on Redis. It follows the KV-event
stream; a batch is applied only if it is the next one of its worker's current generation:

    (worker, generation, seq) vs. what the mirror last applied for that worker
      same generation, seq == last + 1  -> applied
      same generation, seq <= last      -> duplicate, ignored
      same generation, seq >  last + 1  -> gap: the worker's set must be reloaded (resync)
      newer generation                  -> the worker restarted or cleared: reload
      older generation                  -> stale, ignored
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_DEVICE, AllCleared, BlockRemoved, BlockStored, EventBatch

WorkerId = NewType("WorkerId", str)


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"
    NEEDS_RESYNC = "needs_resync"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading blocks of a prompt's chain that one worker holds."""

    num_blocks: int  # on any tier
    num_device_blocks: int  # the leading run of those that sits on the device tier


@dataclass(slots=True)
class _WorkerCursor:
    generation: int
    seq: int


class IndexMirror:
    """Block -> holders map for every known worker.

    Invariants (checked by `check_invariants`):
      * block_to_holders[h][w] == t  iff  worker_blocks[w][h] == t
      * no hash maps to an empty holder dict
      * every worker with blocks has a cursor (generation, last applied seq)
    """

    def __init__(self) -> None:
        self._block_to_holders: dict[BlockHash, dict[WorkerId, int]] = {}
        self._worker_blocks: dict[WorkerId, dict[BlockHash, int]] = {}
        self._cursors: dict[WorkerId, _WorkerCursor] = {}
        self.num_events_applied = 0

    @property
    def num_blocks(self) -> int:
        return len(self._block_to_holders)

    def workers(self) -> list[WorkerId]:
        return list(self._cursors)

    def num_worker_blocks(self, worker: WorkerId) -> int:
        return len(self._worker_blocks.get(worker, ()))

    def worker_hashes(self, worker: WorkerId) -> dict[BlockHash, int]:
        return dict(self._worker_blocks.get(worker, {}))

    def cursor(self, worker: WorkerId) -> tuple[int, int] | None:
        c = self._cursors.get(worker)
        return None if c is None else (c.generation, c.seq)

    def apply(self, batch: EventBatch) -> ApplyResult:
        worker = WorkerId(batch.worker_id)
        cursor = self._cursors.get(worker)
        if cursor is None or batch.generation > cursor.generation:
            return ApplyResult.NEEDS_RESYNC
        if batch.generation < cursor.generation:
            return ApplyResult.STALE
        if batch.seq <= cursor.seq:
            return ApplyResult.DUPLICATE
        if batch.seq > cursor.seq + 1:
            return ApplyResult.NEEDS_RESYNC
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._add(worker, event.hashes, event.tier)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, event.hashes, event.tier)
            elif isinstance(event, AllCleared):
                self._remove(worker, list(self._worker_blocks.get(worker, {})), None)
        cursor.seq = batch.seq
        self.num_events_applied += batch.num_block_events
        return ApplyResult.APPLIED

    def load_worker(
        self, worker: WorkerId, generation: int, seq: int, blocks: Iterable[tuple[BlockHash, int]]
    ) -> None:
        """Replace everything known about `worker` with a full snapshot (resync)."""
        self.remove_worker(worker)
        self._cursors[worker] = _WorkerCursor(generation, seq)
        owned = self._worker_blocks.setdefault(worker, {})
        for h, tier in blocks:
            owned[h] = tier
            self._block_to_holders.setdefault(h, {})[worker] = tier

    def remove_worker(self, worker: WorkerId) -> int:
        """Purge a worker (dead or restarting); returns how many of its blocks were dropped."""
        owned = self._worker_blocks.pop(worker, {})
        for h in owned:
            holders = self._block_to_holders.get(h)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._block_to_holders[h]
        self._cursors.pop(worker, None)
        return len(owned)

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        """Per worker, how many leading blocks of `hashes` it holds (workers with none omitted)."""
        if not hashes:
            return {}
        first = self._block_to_holders.get(hashes[0])
        if not first:
            return {}
        active = set(first)
        num_blocks: dict[WorkerId, int] = {}
        num_device: dict[WorkerId, int] = {w: 0 for w in active}
        on_device = {w for w, t in first.items() if t == TIER_DEVICE}
        for i, h in enumerate(hashes):
            holders = self._block_to_holders.get(h)
            if holders is None:
                for w in active:
                    num_blocks[w] = i
                active = set()
                break
            if not holders.keys() >= active:
                for w in [w for w in active if w not in holders]:
                    num_blocks[w] = i
                    active.discard(w)
            if on_device:
                for w in [w for w in on_device if holders.get(w) != TIER_DEVICE]:
                    num_device[w] = i
                    on_device.discard(w)
            if not active:
                break
        for w in active:
            num_blocks[w] = len(hashes)
        for w in on_device:
            num_device[w] = num_blocks[w]
        return {w: PrefixMatch(n, num_device[w]) for w, n in num_blocks.items()}

    def _add(self, worker: WorkerId, hashes: Iterable[BlockHash], tier: int) -> None:
        owned = self._worker_blocks.setdefault(worker, {})
        for h in hashes:
            owned[h] = tier
            self._block_to_holders.setdefault(h, {})[worker] = tier

    def _remove(self, worker: WorkerId, hashes: Iterable[BlockHash], tier: int | None) -> None:
        owned = self._worker_blocks.get(worker)
        if owned is None:
            return
        for h in hashes:
            held = owned.get(h)
            if held is None or (tier is not None and held != tier):
                continue  # a removal from another tier than the one indexed: keep ours
            del owned[h]
            holders = self._block_to_holders[h]
            del holders[worker]
            if not holders:
                del self._block_to_holders[h]

    def check_invariants(self) -> None:
        for h, holders in self._block_to_holders.items():
            assert holders, f"hash {h:#x} has no holders"
            for w, t in holders.items():
                assert self._worker_blocks.get(w, {}).get(h) == t, f"{w} / {h:#x} not mirrored"
        for w, owned in self._worker_blocks.items():
            assert w in self._cursors, f"worker {w} has blocks but no cursor"
            for h, t in owned.items():
                assert self._block_to_holders.get(h, {}).get(w) == t, f"{w} / {h:#x} not indexed"
