"""Metadata of the fixed set of KV blocks on one device (the tensors live in the model runner).

A block is either *used* (ref_count > 0: some running sequence reads it) or *free*. Free blocks
sit on an LRU queue; a free block that was registered keeps its hash, so a later request can
still match it, until the queue hands it out again (only then is its hash dropped and a `removed`
event recorded).

    free queue:   head (evicted first) ...................................... tail (kept longest)
                  [unhashed blocks][ older finished suffixes ][ newest prefix blocks, root last ]

A finished sequence frees its blocks tail first, so its prefix outlives its suffix. A block is
*registered* only once every slot in it is written; registering a hash that is already held by
another block keeps the first block (the duplicate stays unregistered and is reused first).

*Protected* blocks (a warm idle session's chain, see `warm_sessions.py`) wait on a second free
queue that is handed out only once the ordinary one is empty, so they outlive every ordinary free
block; protection is dropped when such a block is reallocated (`drain_lost_protection` says which):

    allocate():   ordinary free queue (LRU) first ........ then the warm queue (LRU)

Which blocks `allocate` takes follows the queues; it hands them out in runs (`block_runs`):
ascending, and with `run_blocks` > 1 a piece that would break a group of that many table entries
grows by the free blocks beside it while the last piece gives back as many. A copy of a cached
block made to keep a prompt's table in runs takes its hash over once written (`take_over`), and
a protected block's protection too where one warm session alone keeps it
(`drain_moved_protection` tells the sessions which block to rename).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_DEVICE, BlockRemoved, BlockStored, KVEvent
from kvmesh.workers.kv.block_runs import in_runs

BlockId = NewType("BlockId", int)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    num_blocks: int
    num_free: int
    num_cached: int  # registered blocks (free or used): what the index should hold


class BlockPool:
    """Fixed set of KV blocks on one device.

    Invariants (checked by `check_invariants`):
      * a block is on exactly one free queue iff its ref_count == 0; a free block is on the warm
        queue iff it is protected
      * a protected block is registered
      * num_free (both queues) + num_used == num_blocks
      * hash_to_block[h] == b iff block_hash[b] == h (every registered block, free or used)
      * a free block keeps its hash (still matchable) until it is reallocated
    """

    def __init__(self, num_blocks: int, *, run_blocks: int = 1) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if run_blocks < 1:
            raise ValueError(f"run_blocks must be positive, got {run_blocks}")
        self.num_blocks = num_blocks
        self.run_blocks = run_blocks
        """Allocations are handed out so each group of this many is a run where the free
        blocks allow (`block_runs`): cuDNN reads such a run as one page."""
        self._ref_count = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # Radix links of registered blocks (parent hash, depth; 0 = unknown), re-published whole.
        self._block_parent: list[BlockHash] = [BlockHash(0)] * num_blocks
        self._block_depth = [0] * num_blocks
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        self.num_hash_changes = 0
        """Grows whenever a hash becomes matchable or stops being (what `match_prefix` answers
        can change only then): readers cache a match against it."""
        # Insertion order is eviction order: the first key is handed out first.
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(b), None) for b in range(num_blocks)
        )
        # Free protected blocks, handed out only when `_free` is empty (same order rules).
        self._warm: OrderedDict[BlockId, None] = OrderedDict()
        self._protected: set[BlockId] = set()
        self._lost_protection: list[BlockId] = []
        self._moved_protection: list[tuple[BlockId, BlockId]] = []
        self._pending_events: list[KVEvent] = []
        # The chain being registered, one `stored` event once closed (a list, not a growing
        # tuple: a 512-block prefill would copy its run 512 times).
        self._run: list[BlockHash] = []
        self._run_link: tuple[BlockHash, int] = (BlockHash(0), 0)
        # Registered blocks handed out again since the last drain: their KV is about to be
        # overwritten, so a host tier must copy them out first.
        self._evicted: list[tuple[BlockId, BlockHash]] = []
        self.num_evicted = 0
        """Registered blocks handed out again since start (their hash dropped): evictions."""

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._warm)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_protected(self) -> int:
        return len(self._protected)

    def is_protected(self, block: BlockId) -> bool:
        return block in self._protected

    @property
    def num_cached(self) -> int:
        return len(self._hash_to_block)

    def usage(self) -> PoolUsage:
        return PoolUsage(self.num_blocks, self.num_free, self.num_cached)

    def ref_count(self, block: BlockId) -> int:
        return self._ref_count[block]

    def block_hash(self, block: BlockId) -> BlockHash | None:
        return self._block_hash[block]

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._hash_to_block)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks holding the longest registered prefix of `hashes`; refs are not taken.

        Call `acquire` on the result before anything else allocates, or the blocks may be evicted.
        """
        matched: list[BlockId] = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    def num_free_of(self, blocks: Sequence[BlockId]) -> int:
        """How many of `blocks` are free (ref_count 0): what acquiring them takes off the free
        queues."""
        ref_count = self._ref_count
        return [ref_count[b] for b in blocks].count(0)

    def acquire(self, blocks: Sequence[BlockId]) -> None:
        """Take a reference on blocks returned by `match_prefix` (they may be free or in use)."""
        # (locals: this runs once per block of every matched prefix, hundreds per admission)
        ref_count, protected = self._ref_count, self._protected
        for b in blocks:
            if ref_count[b] == 0:
                (self._warm if b in protected else self._free).pop(b)
            ref_count[b] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def next_allocation(self, num_blocks: int) -> list[BlockId] | None:
        """The blocks `allocate(num_blocks)` would hand out now, in its order; nothing changes.
        None if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free:
            return None
        free = self._free
        taken = list(itertools.islice(itertools.chain(free, self._warm), num_blocks))
        return [
            BlockId(b) for b in in_runs(taken, self.run_blocks, free.__contains__, self.num_blocks)
        ]

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Fresh blocks with ref_count 1, evicting the least recently freed; None if too few.

        Handed out in runs (`block_runs`): blocks freed together (a sequence's run) come back
        as a run, which cuDNN reads as longer pages (`cudnn_pages.blocks_per_page`)."""
        blocks = self.next_allocation(num_blocks)
        if blocks is None:
            return None  # expected: the scheduler waits or preempts
        free, warm = self._free, self._warm
        evicted: list[BlockHash] = []
        for b in blocks:
            if b in free:
                del free[b]
            else:
                del warm[b]
                self._protected.discard(b)
                self._lost_protection.append(b)
            h = self._block_hash[b]
            if h is not None:
                del self._hash_to_block[h]
                self._block_hash[b] = None
                evicted.append(h)
                self._evicted.append((b, h))
                self.num_evicted += 1
            self._ref_count[b] = 1
        if evicted:
            self.num_hash_changes += 1
            self._close_run()
            self._pending_events.append(BlockRemoved(tuple(evicted)))
        return blocks

    def register(
        self, block: BlockId, block_hash: BlockHash, parent: BlockHash, *, depth: int = 0
    ) -> bool:
        """Make a fully written, referenced block matchable; False if the hash is already held.
        `parent` and `depth` (1: first block after the root; 0: unknown) are its radix link."""
        return self.register_run([block], [block_hash], parent, depth)

    def register_run(
        self,
        blocks: Sequence[BlockId],
        hashes: Sequence[BlockHash],
        parent: BlockHash,
        depth: int = 0,
    ) -> bool:
        """`register` a chain at once: `blocks[i]` as `hashes[i]`, the first after `parent` at
        `depth` (0: unknown, for all of them), each after the one before. False if any hash was
        already held (that block stays unregistered; the rest are registered all the same).
        One pass with the state in locals: a prefill or a pull registers hundreds of blocks.
        Raises ValueError for a free block, or one that holds another hash."""
        if len(blocks) != len(hashes):
            raise ValueError(f"{len(blocks)} blocks for {len(hashes)} hashes")
        ref_count, block_hash = self._ref_count, self._block_hash
        hash_to_block = self._hash_to_block
        block_parent, block_depth = self._block_parent, self._block_depth
        all_registered = True
        for block, h in zip(blocks, hashes, strict=True):
            if ref_count[block] == 0:
                raise ValueError(f"block {block} is free; register it before freeing it")
            current = block_hash[block]
            if current is not None:
                if current != h:
                    raise ValueError(f"block {block} already holds hash {current:#x}")
            elif h in hash_to_block:
                all_registered = False
            else:
                block_hash[block] = h
                hash_to_block[h] = block
                self.num_hash_changes += 1
                block_parent[block] = parent
                block_depth[block] = depth
                self._append_stored(h, parent, depth)
            parent = h
            if depth:
                depth += 1
        return all_registered

    def take_over(
        self,
        blocks: Sequence[BlockId],
        hashes: Sequence[BlockHash],
        parent: BlockHash,
        depth: int = 0,
        *,
        protected_may_move: Callable[[BlockId], bool] = lambda block: False,
    ) -> int:
        """`register_run` for copies of registered blocks (`block_runs.relocated_tail`): where
        another block holds a hash, that block hands it to the copy and keeps its KV unnamed
        (free: it goes to the head of the free queue, to be reused first). A protected holder
        hands its protection over too where `protected_may_move(holder)` says so (a warm
        session then renames the block in its chain: `drain_moved_protection`), else keeps its
        hash, and its copy stays unnamed. No event: the worker holds the same hashes. Returns
        how many changed hands."""
        if len(blocks) != len(hashes):
            raise ValueError(f"{len(blocks)} blocks for {len(hashes)} hashes")
        block_hash, hash_to_block, protected = (
            self._block_hash,
            self._hash_to_block,
            self._protected,
        )
        moved = 0
        for block, h in zip(blocks, hashes, strict=True):
            holder = hash_to_block.get(h)
            if holder is None or holder == block:
                continue
            if holder in protected and not protected_may_move(holder):
                continue
            if self._ref_count[block] == 0 or block_hash[block] is not None:
                raise ValueError(f"block {block} is free or named; only a held copy takes over")
            block_hash[holder], block_hash[block] = None, h
            hash_to_block[h] = block
            self._block_parent[block] = self._block_parent[holder]
            self._block_depth[block] = self._block_depth[holder]
            if holder in protected:
                protected.discard(holder)
                protected.add(block)
                self._moved_protection.append((holder, block))
                if self._ref_count[holder] == 0:
                    del self._warm[holder]
                    self._free[holder] = None
            if self._ref_count[holder] == 0:
                self._free.move_to_end(holder, last=False)
            moved += 1
        if moved:
            self.num_hash_changes += 1
        self.register_run(blocks, hashes, parent, depth)  # hashes no block held any more
        return moved

    def free(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference from each block of a sequence, given in sequence order.

        Blocks reaching ref_count 0 join the free queue tail first, so the root of a chain is the
        last of them to be evicted; unregistered blocks go to the head, to be reused first.
        """
        ref_count, block_hash = self._ref_count, self._block_hash
        free, protected = self._free, self._protected
        for b in reversed(blocks):
            num_refs = ref_count[b]
            if num_refs <= 0:
                raise ValueError(f"block {b} freed more often than acquired")
            ref_count[b] = num_refs - 1
            if num_refs == 1:
                if b in protected:
                    self._warm[b] = None
                    continue
                free[b] = None
                if block_hash[b] is None:
                    free.move_to_end(b, last=False)

    def protect(self, blocks: Sequence[BlockId]) -> None:
        """Keep registered blocks (a chain, in chain order) past every ordinary free block.
        Free ones move to the warm queue as if freed now, tail first (the root goes last)."""
        for b in reversed(blocks):
            if self._block_hash[b] is None:
                raise ValueError(f"block {b} is not registered; only a cached chain is protected")
            if b in self._protected:
                if self._ref_count[b] == 0:
                    self._warm.move_to_end(b)
                continue
            self._protected.add(b)
            if self._ref_count[b] == 0:
                del self._free[b]
                self._warm[b] = None

    def unprotect(self, blocks: Sequence[BlockId], *, evict_first: bool = True) -> None:
        """Return blocks (a chain, in chain order) to the ordinary free queue, the chain's tail
        before its root: at the head with `evict_first` (idle past any use: they go first),
        else at the tail, as if just freed (plain LRU from here on). Blocks not protected (any
        more) are skipped."""
        order = blocks if evict_first else list(reversed(blocks))
        for b in order:
            if b not in self._protected:
                continue
            self._protected.discard(b)
            if self._ref_count[b] == 0:
                del self._warm[b]
                self._free[b] = None
                if evict_first:
                    self._free.move_to_end(b, last=False)

    def drain_moved_protection(self) -> list[tuple[BlockId, BlockId]]:
        """(holder, copy) of each protected block whose hash and protection a copy took over
        since the last call (`take_over`)."""
        moved, self._moved_protection = self._moved_protection, []
        return moved

    def drain_lost_protection(self) -> list[BlockId]:
        """Protected blocks reallocated since the last call (the pool had nothing else left)."""
        lost, self._lost_protection = self._lost_protection, []
        return lost

    def evict_all_free(self) -> int:
        """Forget the hashes of every free block (ClearCache); returns how many were dropped.
        Protection ends with the hash: the warm blocks join the ordinary queue."""
        for b in self._warm:
            self._protected.discard(b)
            self._lost_protection.append(b)
            self._free[b] = None
        self._warm.clear()
        dropped: list[BlockHash] = []
        for b in self._free:
            h = self._block_hash[b]
            if h is not None:
                del self._hash_to_block[h]
                self._block_hash[b] = None
                dropped.append(h)
        if dropped:
            self.num_hash_changes += 1
            self._close_run()
            self._pending_events.append(BlockRemoved(tuple(dropped)))
        return len(dropped)

    def next_evicted(self, max_scan: int) -> list[tuple[BlockId, BlockHash]]:
        """(block, hash) of the registered blocks among the first `max_scan` of the free queue:
        the ones `allocate` hands out (and evicts) next, in that order."""
        if max_scan < 0:
            raise ValueError(f"max_scan must be >= 0, got {max_scan}")
        out: list[tuple[BlockId, BlockHash]] = []
        for i, b in enumerate(self._free):
            if i == max_scan:
                break
            h = self._block_hash[b]
            if h is not None:
                out.append((b, h))
        return out

    def drain_evicted(self) -> list[tuple[BlockId, BlockHash]]:
        """(block, hash) of every registered block reallocated since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def drain_events(self) -> list[KVEvent]:
        self._close_run()
        events, self._pending_events = self._pending_events, []
        return events

    def stored_events(self) -> list[BlockStored]:
        """Every registered block as `stored` events with its radix link, a chain per event
        where it can (a full re-publish): each event's blocks follow one another, and a block
        whose parent is registered comes after it.

            registered:  a <- b <- c          events:  [a, b, c] (parent root)
                              ^-- d                    [d] (parent b)
        """
        links = {
            h: (self._block_parent[b], self._block_depth[b]) for h, b in self._hash_to_block.items()
        }
        children: dict[BlockHash, list[BlockHash]] = {}
        starts: list[BlockHash] = []
        for h, (parent, _depth) in links.items():
            if parent in links and parent != h:
                children.setdefault(parent, []).append(h)
            else:
                starts.append(h)
        events: list[BlockStored] = []
        pending = list(reversed(starts))
        while pending:
            run = [pending.pop()]
            while kids := children.get(run[-1]):
                pending.extend(reversed(kids[1:]))
                run.append(kids[0])
            parent, depth = links[run[0]]
            events.append(BlockStored(tuple(run), TIER_DEVICE, parent, depth))
        return events

    def _append_stored(self, block_hash: BlockHash, parent: BlockHash, depth: int) -> None:
        # Coalesce consecutive registrations of one chain into a single event.
        if self._run and self._run[-1] == parent:
            self._run.append(block_hash)
            return
        self._close_run()
        self._run = [block_hash]
        self._run_link = (parent, depth)

    def _close_run(self) -> None:
        if self._run:
            parent, depth = self._run_link
            self._pending_events.append(BlockStored(tuple(self._run), TIER_DEVICE, parent, depth))
            self._run = []

    def check_invariants(self) -> None:
        num_used = 0
        for b in range(self.num_blocks):
            block = BlockId(b)
            rc = self._ref_count[block]
            assert rc >= 0, f"block {b} has ref_count {rc}"
            on_queue = (block in self._free) + (block in self._warm)
            assert on_queue == (rc == 0), f"block {b}: ref {rc}, on {on_queue} free queues"
            if rc == 0:
                assert (block in self._warm) == (block in self._protected), f"block {b}: warm"
            num_used += rc > 0
            h = self._block_hash[block]
            assert h is not None or block not in self._protected, f"block {b}: protected, no hash"
            if h is not None:
                assert self._hash_to_block.get(h) == block, (
                    f"block {b}: hash {h:#x} not mapped back"
                )
        assert num_used + self.num_free == self.num_blocks
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash {h:#x} maps to block {b} holding another hash"
