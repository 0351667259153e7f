"""In-memory mirror of the global prefix index: which worker holds which block, on which tier.

The hot path (routing) reads only this mirror and never waits on Redis. It follows the KV-event
stream; a batch is applied only if it is the next one of its worker's current generation:

    (worker, generation, seq) vs. what the mirror last applied for that worker
      same generation, seq == last + 1  -> applied
      same generation, seq <= last      -> duplicate, ignored
      same generation, seq >  last + 1  -> gap: the worker's set must be reloaded (resync)
      newer generation, seq == 1        -> the worker restarted or cleared: its older blocks
                                           go, the batch applies (as Redis does it)
      newer generation, seq >  1        -> its start was missed: reload
      older generation                  -> stale, ignored
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, NewType

import numpy as np

from kvmesh.coordinator.index.hash_table import FEW_HASHES, NOBODY, HashTable
from kvmesh.coordinator.index.holder_sets import HolderSets
from kvmesh.coordinator.index.radix_tree import RadixTree
from kvmesh.coordinator.index.worker_bits import WorkerBits
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_DEVICE, AllCleared, BlockRemoved, BlockStored, EventBatch

WorkerId = NewType("WorkerId", str)


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"
    NEEDS_RESYNC = "needs_resync"
    STARTED = "started"
    """Applied as the first batch of a new generation (or of a worker not known yet): the
    worker's older blocks went first, as Redis wipes them before that batch (`APPLY_BATCH`),
    so the batches from here on are its whole state and no snapshot is needed."""


class PrefixMatch(NamedTuple):
    """Leading blocks of a prompt's chain that one worker holds. A NamedTuple: `match` builds
    one per holder per routed prompt, and a tuple is built several times faster."""

    num_blocks: int  # on any tier
    num_device_blocks: int  # the leading run of those that sits on the device tier


class FleetMatch(NamedTuple):
    """`match` as columns of one fleet: row i is the fleet's worker at row i (0 if it holds
    nothing of the chain)."""

    num_blocks: np.ndarray
    """Leading blocks held, any tier (int64)."""
    num_device_blocks: np.ndarray
    """... of which the leading run on the device tier (int64)."""
    deepest: int
    """The longest match of any worker, in the fleet or not (0: nobody holds the first)."""


@dataclass(slots=True)
class _WorkerCursor:
    generation: int
    seq: int


class IndexMirror:
    """Block -> holders for every known worker, in about 12 bytes per block.

    Each worker gets a bit. Blocks held by the same workers on the same tiers share one interned
    *holder set* (an any-tier mask and a device-tier mask of bits; id 0 is nobody), so a block
    costs a hash and a set id; there are few distinct sets, however many blocks:

        _table  block hash -> holder set id: arrays in the order blocks were stored, an index
                of home slots over them and a delta of recent changes (`hash_table.py`)
        _sets   holder set id -> bitmask of its workers (any tier; device tier), reference
                counts, and the walks over a chain's runs of sets (`holder_sets.py`)
        _bits   worker <-> bit, and the bits' rows in the fleet being routed to
                (`worker_bits.py`)

    `match` looks a chain up at once and walks only the positions where the holder set changes.
    The radix tree of the indexed blocks (`self.tree`, `radix_tree.py`) is fed from here but
    kept apart: its links cost their own memory, and only for blocks whose parent was announced.

    Invariants (checked by `check_invariants`):
      * refs[s] == number of blocks whose current set is s (s != 0); the sets' own
        (`HolderSets.check_invariants`)
      * bit(w) is in any(s) of a block's set s iff w holds it; in device(s) iff on the device tier
      * num_worker_blocks(w) == blocks whose set has bit(w); num_blocks == blocks with a set != 0
      * every worker with blocks has a cursor and a bit
      * the table's and the bits' own (`HashTable`, `WorkerBits.check_invariants`)
      * the radix tree links only indexed hashes (a hash leaves it when it leaves the index)
    """

    def __init__(self) -> None:
        self._table = HashTable()
        self._sets = HolderSets()
        self._num_blocks = 0
        self._num_blocks_of: dict[WorkerId, int] = {}
        self._cursors: dict[WorkerId, _WorkerCursor] = {}
        self._bits = WorkerBits()
        self.num_events_applied = 0
        self.tree = RadixTree()
        """Parent and depth of the indexed blocks, from the stored events (`radix_tree.py`)."""

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def workers(self) -> list[WorkerId]:
        return list(self._cursors)

    def num_worker_blocks(self, worker: WorkerId) -> int:
        return self._num_blocks_of.get(worker, 0)

    def worker_hashes(self, worker: WorkerId) -> dict[BlockHash, int]:
        bit = self._bits.get(worker)
        if not bit or not self._num_blocks_of.get(worker):
            return {}
        self._table.merge()
        sets = self._sets
        held = [s for s, m in enumerate(sets.any) if m & bit and sets.refs[s]]
        on_device = np.array([bool(sets.device[s] & bit) for s in held], dtype=bool)
        rows = np.flatnonzero(np.isin(self._table.values, held))
        tiers = np.where(on_device[np.searchsorted(held, self._table.values[rows])], TIER_DEVICE, 1)
        return dict(zip(self._table.keys[rows].tolist(), tiers.tolist(), strict=True))

    def holders(self, h: BlockHash) -> dict[WorkerId, int]:
        """worker -> tier of every worker holding block `h`."""
        s = int(self._table.lookup((h,))[0])
        mask, device, out = self._sets.any[s], self._sets.device[s], {}
        while mask:
            low = mask & -mask
            out[self._bits.worker_of_bit[low]] = TIER_DEVICE if device & low else 1
            mask ^= low
        return out

    def indexed(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether some worker holds each of `hashes` (one vectorised lookup)."""
        if not hashes:
            return []
        return (self._table.lookup(hashes) != NOBODY).tolist()

    def cursor(self, worker: WorkerId) -> tuple[int, int] | None:
        c = self._cursors.get(worker)
        return None if c is None else (c.generation, c.seq)

    def apply(self, batch: EventBatch) -> ApplyResult:
        worker = WorkerId(batch.worker_id)
        cursor = self._cursors.get(worker)
        removed: list[BlockHash] = []
        started = cursor is None or batch.generation > cursor.generation
        if started:
            if batch.seq != 1:  # the generation's start is gone (trimmed, or read before)
                return ApplyResult.NEEDS_RESYNC
            removed = self._drop_worker(worker)
            cursor = self._cursors[worker] = _WorkerCursor(batch.generation, 0)
        assert cursor is not None
        if batch.generation < cursor.generation:
            return ApplyResult.STALE
        if batch.seq <= cursor.seq:
            return ApplyResult.DUPLICATE
        if batch.seq > cursor.seq + 1:
            return ApplyResult.NEEDS_RESYNC
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._add(worker, event.hashes, event.tier)
                self.tree.link(event.hashes, event.parent_hash, event.depth)
            elif isinstance(event, BlockRemoved):
                removed += self._remove(worker, event.hashes, event.tier)
            elif isinstance(event, AllCleared):
                removed += self._drop_worker_blocks(worker)
        # At the batch's end, as Redis does: a block demoted to the host tier, or re-published
        # after a clear, keeps its link.
        self._unlink_unindexed(removed)
        cursor.seq = batch.seq
        self.num_events_applied += batch.num_block_events
        self._table.maybe_merge()
        return ApplyResult.STARTED if started else ApplyResult.APPLIED

    def load_worker(
        self, worker: WorkerId, generation: int, seq: int, blocks: Iterable[tuple[BlockHash, int]]
    ) -> None:
        """Replace everything known about `worker` with a full snapshot (resync). The links of
        blocks it still holds stay in the tree."""
        before = self._drop_worker(worker)
        self._cursors[worker] = _WorkerCursor(generation, seq)
        by_tier: dict[int, list[BlockHash]] = {}
        for h, tier in blocks:
            by_tier.setdefault(tier, []).append(h)
        for tier, hashes in by_tier.items():
            self._add(worker, hashes, tier)
        self._unlink_unindexed(before)
        self._table.maybe_merge()

    def remove_worker(self, worker: WorkerId) -> int:
        """Purge a worker (dead or restarting); returns how many of its blocks were dropped."""
        num_held = self._num_blocks_of.get(worker, 0)
        self._unlink_unindexed(self._drop_worker(worker))
        return num_held

    def _drop_worker(self, worker: WorkerId) -> list[BlockHash]:
        """Forget the worker (blocks, bit, cursor); returns the blocks nobody holds any more."""
        orphaned = self._drop_worker_blocks(worker)
        self._bits.release(worker)
        self._cursors.pop(worker, None)
        self._num_blocks_of.pop(worker, None)
        return orphaned

    def _unlink_unindexed(self, hashes: Sequence[BlockHash]) -> None:
        """Unlink those of `hashes` that no worker holds (any more) from the tree."""
        tree = self.tree
        if not hashes or not tree.num_nodes:
            return
        for h, held in zip(hashes, self.indexed(hashes), strict=True):
            if not held:
                tree.unlink(h)

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        """Per worker, how many leading blocks of `hashes` it holds (workers with none omitted)."""
        if not hashes:
            return {}
        starts, run_sets = self._runs(hashes)
        if not run_sets[0]:
            return {}
        num_blocks, num_device = self._sets.walk(starts, run_sets, len(hashes))
        worker_of_bit, device_get = self._bits.worker_of_bit, num_device.get
        return {worker_of_bit[b]: PrefixMatch(n, device_get(b, 0)) for b, n in num_blocks.items()}

    def match_fleet(
        self,
        hashes: Sequence[BlockHash],
        row_of: Mapping[WorkerId, int],
        num_rows: int,
        hash_array: np.ndarray | None = None,
    ) -> FleetMatch:
        """`match` written into the columns of a fleet of `num_rows` workers (`row_of`: a
        worker's row; workers outside the fleet are left out). The same numbers as `match`.
        The rows of the workers' bits are kept while the same `row_of` object comes: another
        fleet is another mapping, never the same one changed. `hash_array`: `hashes` as a
        uint64 array (`block_hash_array`), when the caller made one with them."""
        fleet = self._bits.fleet(row_of, num_rows)
        if len(hashes) > FEW_HASHES and fleet.positions is not None and not self._sets.num_tiered:
            return self._match_fleet_low(hashes, hash_array, fleet.positions)
        num_blocks = np.zeros(num_rows, dtype=np.int64)
        num_device = np.zeros(num_rows, dtype=np.int64)
        if not hashes:
            return FleetMatch(num_blocks, num_device, 0)
        starts, run_sets = self._runs(hashes, hash_array)
        first = run_sets[0]
        if not first:
            return FleetMatch(num_blocks, num_device, 0)
        if len(run_sets) == 1 or (len(run_sets) == 2 and run_sets[1] == NOBODY):
            # One holder set, then nobody (the common case: a new prompt on a shared head): its
            # workers all hold the same run, written at once (their rows kept per fleet).
            sets = self._sets
            if not sets.num_tiered or sets.device[first] == sets.any[first]:
                end = len(hashes) if len(run_sets) == 1 else starts[1]
                num_blocks[fleet.rows_of(sets.any[first])] = end
                return FleetMatch(num_blocks, num_blocks.copy(), end)
        by_bit, device_by_bit = self._sets.walk(starts, run_sets, len(hashes))
        row_of_bit = fleet.row_of_bit
        if len(row_of_bit) == len(self._bits):  # every worker with a bit is in the fleet
            bits = list(by_bit)
        else:
            bits = [b for b in by_bit if b in row_of_bit]
        rows = list(map(row_of_bit.__getitem__, bits))
        held = list(map(by_bit.__getitem__, bits))
        if device_by_bit is by_bit:
            held_device = held
        else:
            held_device = list(map(device_by_bit.get, bits, repeat(0)))
        if len(rows) > 1:
            num_blocks[rows] = held
            if device_by_bit is by_bit:  # every block on the device tier: the same numbers
                num_device = num_blocks.copy()
            else:
                num_device[rows] = held_device
        elif rows:  # one holder, the common case in a large fleet: no list-to-array conversions
            num_blocks[rows[0]], num_device[rows[0]] = held[0], held_device[0]
        return FleetMatch(num_blocks, num_device, max(by_bit.values(), default=0))

    def _match_fleet_low(
        self, hashes: Sequence[BlockHash], hash_array: np.ndarray | None, positions: np.ndarray
    ) -> FleetMatch:
        """`match_fleet` of a long chain in array operations, where every worker's bit is below
        64 and every block on the device tier (`positions`: `FleetBits.positions`): the runs
        as arrays, walked by `HolderSets.walk_low`."""
        # (through the first block nobody holds: no worker's prefix goes past it, so the walk
        # reads no further)
        sets = self._table.lookup_chain(hashes, hash_array)
        changed = np.empty(len(sets), dtype=bool)
        changed[0] = True
        np.not_equal(sets[1:], sets[:-1], out=changed[1:])
        starts = changed.nonzero()[0]
        by_position = self._sets.walk_low(starts, sets.take(starts), len(hashes))
        num_blocks = by_position.take(positions)
        # (the deepest read at its `argmax`: the same int as a reduction's, ~0.7 us less)
        deepest = by_position.item(by_position.argmax())
        return FleetMatch(num_blocks, num_blocks.copy(), deepest)

    def _runs(
        self, hashes: Sequence[BlockHash], hash_array: np.ndarray | None = None
    ) -> tuple[list[int], list[int]]:
        """Where the chain's holder set changes, and to what: (first positions of the runs of
        one holder set, their sets). Only there can a worker's prefix end; the runs may stop
        at the first block nobody holds (no worker's prefix goes past it)."""
        if len(hashes) > FEW_HASHES:
            # (through the first block nobody holds; from its first hash in Python ints, so a
            # long chain that nobody holds past its head, a new conversation on a shared
            # system prompt, stops there)
            return self._runs_of_array(self._table.lookup_chain(hashes, hash_array))
        sets = self._table.lookup_few(hashes, leading=True)
        starts = [i for i in range(len(sets)) if not i or sets[i] != sets[i - 1]]
        return starts, [sets[i] for i in starts]

    @staticmethod
    def _runs_of_array(array: np.ndarray) -> tuple[list[int], list[int]]:
        """`_runs` of a whole chain's holder sets, looked up as one array."""
        at = (array[1:] != array[:-1]).nonzero()[0] + 1
        return [0, *at.tolist()], [int(array[0]), *array[at].tolist()]

    def _move(self, h: BlockHash, row: int, old: int, new: int) -> None:
        """Block `h` goes from holder set `old` to `new` (refs, the block count, and the table:
        the arrays' `row` of it, or the delta where it has none, -1)."""
        if old:
            self._sets.unref(old)
        else:
            self._num_blocks += 1
        if new:
            self._sets.ref(new)
        else:
            self._num_blocks -= 1
        if row >= 0:
            self._table.values[row] = new
        else:
            self._table.delta[h] = new

    def _add(self, worker: WorkerId, hashes: Sequence[BlockHash], tier: int) -> None:
        if not hashes:
            return
        bit = self._bits.bit(worker)
        wanted = np.fromiter(hashes, np.uint64, len(hashes))
        rows = self._table.find(wanted).tolist()  # -1: not in the table's arrays
        self._table.note_changing(wanted)
        set_any, set_device, delta = self._sets.any, self._sets.device, self._table.delta
        set_of_row = self._table.values.item
        # Blocks nobody holds (in neither the arrays nor the delta: most of a stored chain) all
        # go to one holder set, in bulk; the rest one by one.
        fresh: dict[BlockHash, None] = {}
        rest: list[tuple[BlockHash, int]] = []
        for h, row in zip(hashes, rows, strict=True):
            if row < 0 and h not in delta:
                fresh[h] = None  # a hash twice in one event is one block
            else:
                rest.append((h, row))
        added = len(fresh)
        if fresh:
            s = self._sets.intern(bit, bit if tier == TIER_DEVICE else 0)
            self._sets.ref(s, added)
            self._num_blocks += added
            delta.update(dict.fromkeys(fresh, s))
        for h, row in rest:
            # read as the loop goes: a hash twice in one event sees its first store
            s = set_of_row(row) if row >= 0 else delta.get(h, NOBODY)
            any_mask = set_any[s]
            device = set_device[s] | bit if tier == TIER_DEVICE else set_device[s] & ~bit
            if any_mask & bit and device == set_device[s]:
                continue
            added += not any_mask & bit
            self._move(h, row, s, self._sets.intern(any_mask | bit, device))
        if added:
            self._num_blocks_of[worker] = self._num_blocks_of.get(worker, 0) + added

    def _remove(self, worker: WorkerId, hashes: Sequence[BlockHash], tier: int) -> list[BlockHash]:
        """Drop the worker's hold on `hashes`; returns those it held."""
        bit = self._bits.get(worker)
        if not bit or not self._num_blocks_of.get(worker) or not hashes:
            return []  # nothing indexed (a worker gets its bit with its first block)
        wanted = np.fromiter(hashes, np.uint64, len(hashes))
        rows = self._table.find(wanted).tolist()  # -1: not in the table's arrays
        self._table.note_changing(wanted)
        set_any, set_device, delta = self._sets.any, self._sets.device, self._table.delta
        set_of_row = self._table.values.item
        removed: list[BlockHash] = []
        for h, row in zip(hashes, rows, strict=True):
            s = set_of_row(row) if row >= 0 else delta.get(h, NOBODY)
            if not set_any[s] & bit:
                continue
            held = TIER_DEVICE if set_device[s] & bit else 1
            if held != tier:
                continue  # a removal from another tier than the one indexed: keep ours
            self._move(h, row, s, self._sets.intern(set_any[s] & ~bit, set_device[s] & ~bit))
            removed.append(h)
        self._num_blocks_of[worker] -= len(removed)
        return removed

    def _drop_worker_blocks(self, worker: WorkerId) -> list[BlockHash]:
        """Take the worker's bit out of every block (one pass over the arrays, no per-block
        Python); returns the blocks nobody holds any more (their links may have to go)."""
        bit = self._bits.get(worker)
        if not bit or not self._num_blocks_of.get(worker, 0):
            return []
        self._table.merge()
        sets = self._sets
        remap = np.arange(len(sets), dtype=np.uint32)
        for s, any_mask in enumerate(sets.any):  # (sets interned on the way have no refs)
            if sets.refs[s] and any_mask & bit:
                remap[s] = sets.intern(any_mask & ~bit, sets.device[s] & ~bit)
        old = self._table.values
        new = remap[old]
        changed = old != new
        counts_old = np.bincount(old[changed], minlength=len(sets))
        counts_new = np.bincount(new[changed], minlength=len(sets))
        for s in np.flatnonzero(counts_new).tolist():
            sets.ref(s, int(counts_new[s]))
        for s in np.flatnonzero(counts_old).tolist():
            sets.unref(s, int(counts_old[s]))
        self._num_blocks -= int(counts_new[NOBODY])
        self._table.values = new
        self._num_blocks_of[worker] = 0
        if not self.tree.num_nodes:
            return []
        orphaned: list[BlockHash] = self._table.keys[changed & (new == NOBODY)].tolist()
        return orphaned

    def check_invariants(self) -> None:
        self._table.check_invariants()  # merges the delta
        self._sets.check_invariants()
        sets = self._table.values
        counts = np.bincount(sets, minlength=len(self._sets))
        for s, refs in enumerate(self._sets.refs):
            if s != NOBODY:
                live = self._sets.is_interned(s)
                assert refs == (counts[s] if live else 0), f"set {s}: {refs} refs, {counts[s]}"
        assert self._num_blocks == int(np.count_nonzero(sets)), "block count drifted"
        self._bits.check_invariants()
        for w, bit in self._bits.bit_of.items():
            held = [s for s, m in enumerate(self._sets.any) if m & bit and self._sets.refs[s]]
            assert self.num_worker_blocks(w) == int(counts[held].sum()), f"{w}'s count drifted"
        for w, n in self._num_blocks_of.items():
            assert not n or (w in self._cursors and w in self._bits.bit_of), f"{w} has blocks only"
        self.tree.check_invariants(set(self._table.keys[sets != NOBODY].tolist()))
