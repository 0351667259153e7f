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

from kvmesh.coordinator.index.radix_tree import RadixTree
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

    Each worker gets a bit; a block's holders are an integer bitmask (any tier) plus a second
    mask of those holding it on the device tier, so `match` walks a chain with one AND per block.

    Invariants (checked by `check_invariants`):
      * bit(w) is set in any_mask[h] iff h in worker_blocks[w]
      * bit(w) is set in device_mask[h] iff worker_blocks[w][h] == TIER_DEVICE
      * no hash maps to an empty mask; every worker with blocks has a cursor and a bit
      * the radix tree links only indexed hashes (a hash leaves it when it leaves the index)
    """

    def __init__(self) -> None:
        self._any_mask: dict[BlockHash, int] = {}
        self._device_mask: dict[BlockHash, int] = {}
        self._worker_blocks: dict[WorkerId, dict[BlockHash, int]] = {}
        self._cursors: dict[WorkerId, _WorkerCursor] = {}
        self._bit_of: dict[WorkerId, int] = {}
        self._worker_of_bit: dict[int, WorkerId] = {}
        self.num_events_applied = 0
        self.tree = RadixTree()
        """Parent and depth of the indexed blocks, from the stored events (`radix_tree.py`)."""

    @property
    def num_blocks(self) -> int:
        return len(self._any_mask)

    def workers(self) -> list[WorkerId]:
        return list(self._cursors)

    def num_worker_blocks(self, worker: WorkerId) -> int:
        return len(self._worker_blocks.get(worker, ()))

    def worker_hashes(self, worker: WorkerId) -> dict[BlockHash, int]:
        return dict(self._worker_blocks.get(worker, {}))

    def holders(self, h: BlockHash) -> dict[WorkerId, int]:
        """worker -> tier of every worker holding block `h`."""
        mask, out = self._any_mask.get(h, 0), {}
        while mask:
            low = mask & -mask
            worker = self._worker_of_bit[low]
            out[worker] = self._worker_blocks[worker][h]
            mask ^= low
        return out

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
        removed: list[BlockHash] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._add(worker, event.hashes, event.tier)
                self.tree.link(event.hashes, event.parent_hash, event.depth)
            elif isinstance(event, BlockRemoved):
                removed += self._remove(worker, event.hashes, event.tier)
            elif isinstance(event, AllCleared):
                removed += self._remove(worker, list(self._worker_blocks.get(worker, {})), None)
        # At the batch's end, as Redis does: a block demoted to the host tier, or re-published
        # after a clear, keeps its link.
        self._unlink_unindexed(removed)
        cursor.seq = batch.seq
        self.num_events_applied += batch.num_block_events
        return ApplyResult.APPLIED

    def load_worker(
        self, worker: WorkerId, generation: int, seq: int, blocks: Iterable[tuple[BlockHash, int]]
    ) -> None:
        """Replace everything known about `worker` with a full snapshot (resync). The links of
        blocks it still holds stay in the tree."""
        before = self._drop_worker(worker)
        self._cursors[worker] = _WorkerCursor(generation, seq)
        self._worker_blocks[worker] = {}
        for h, tier in blocks:
            self._add(worker, (h,), tier)
        self._unlink_unindexed(before)

    def remove_worker(self, worker: WorkerId) -> int:
        """Purge a worker (dead or restarting); returns how many of its blocks were dropped."""
        owned = self._drop_worker(worker)
        self._unlink_unindexed(owned)
        return len(owned)

    def _unlink_unindexed(self, hashes: Iterable[BlockHash]) -> None:
        any_mask, tree = self._any_mask, self.tree
        for h in hashes:
            if h not in any_mask:
                tree.unlink(h)

    def _drop_worker(self, worker: WorkerId) -> dict[BlockHash, int]:
        owned = self._worker_blocks.pop(worker, {})
        bit = self._bit_of.pop(worker, 0)
        for h in owned:
            self._clear_bit(h, bit)
        if bit:
            del self._worker_of_bit[bit]
        self._cursors.pop(worker, None)
        return owned

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        """Per worker, how many leading blocks of `hashes` it holds (workers with none omitted)."""
        any_mask, device_mask = self._any_mask, self._device_mask
        active = any_mask.get(hashes[0], 0) if hashes else 0
        if not active:
            return {}
        on_device = active
        num_blocks: dict[int, int] = {}
        num_device: dict[int, int] = {}
        i = 0
        for i, h in enumerate(hashes):  # noqa: B007 - i is read after the loop
            held = active & any_mask.get(h, 0)
            if held != active:
                self._record(active & ~held, i, num_blocks)
                active = held
            held_dev = on_device & device_mask.get(h, 0)
            if held_dev != on_device:
                self._record(on_device & ~held_dev, i, num_device)
                on_device = held_dev
            if not active:
                break
        else:
            i = len(hashes)
        self._record(active, i, num_blocks)
        self._record(on_device, i, num_device)
        return {
            self._worker_of_bit[b]: PrefixMatch(n, num_device.get(b, 0))
            for b, n in num_blocks.items()
        }

    @staticmethod
    def _record(mask: int, length: int, out: dict[int, int]) -> None:
        while mask:
            low = mask & -mask
            out[low] = length
            mask ^= low

    def _bit(self, worker: WorkerId) -> int:
        bit = self._bit_of.get(worker)
        if bit is None:
            used = 0
            for b in self._worker_of_bit:
                used |= b
            bit = ~used & (used + 1)  # lowest free bit
            self._bit_of[worker] = bit
            self._worker_of_bit[bit] = worker
        return bit

    def _add(self, worker: WorkerId, hashes: Iterable[BlockHash], tier: int) -> None:
        owned = self._worker_blocks.setdefault(worker, {})
        bit = self._bit(worker)
        for h in hashes:
            owned[h] = tier
            self._any_mask[h] = self._any_mask.get(h, 0) | bit
            if tier == TIER_DEVICE:
                self._device_mask[h] = self._device_mask.get(h, 0) | bit
            else:
                self._clear_device_bit(h, bit)

    def _remove(
        self, worker: WorkerId, hashes: Iterable[BlockHash], tier: int | None
    ) -> list[BlockHash]:
        """Drop the worker's hold on `hashes`; returns those it held."""
        owned = self._worker_blocks.get(worker)
        if not owned:
            return []  # nothing indexed (a worker gets its bit with its first block)
        removed = []
        bit = self._bit_of[worker]
        for h in hashes:
            held = owned.get(h)
            if held is None or (tier is not None and held != tier):
                continue  # a removal from another tier than the one indexed: keep ours
            del owned[h]
            self._clear_bit(h, bit)
            removed.append(h)
        return removed

    def _clear_bit(self, h: BlockHash, bit: int) -> None:
        left = self._any_mask.get(h, 0) & ~bit
        if left:
            self._any_mask[h] = left
        else:
            self._any_mask.pop(h, None)
        self._clear_device_bit(h, bit)

    def _clear_device_bit(self, h: BlockHash, bit: int) -> None:
        left = self._device_mask.get(h, 0) & ~bit
        if left:
            self._device_mask[h] = left
        else:
            self._device_mask.pop(h, None)

    def check_invariants(self) -> None:
        expected_any: dict[BlockHash, int] = {}
        expected_dev: dict[BlockHash, int] = {}
        for w, owned in self._worker_blocks.items():
            assert w in self._cursors, f"worker {w} has blocks but no cursor"
            if not owned:
                continue
            bit = self._bit_of[w]
            assert self._worker_of_bit[bit] == w
            for h, t in owned.items():
                expected_any[h] = expected_any.get(h, 0) | bit
                if t == TIER_DEVICE:
                    expected_dev[h] = expected_dev.get(h, 0) | bit
        assert expected_any == self._any_mask, "holder masks do not match the worker sets"
        assert expected_dev == self._device_mask, "device masks do not match the worker sets"
        self.tree.check_invariants(self._any_mask.keys())
