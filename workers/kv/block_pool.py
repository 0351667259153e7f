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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockRemoved, BlockStored, KVEvent

BlockId = NewType("BlockId", int)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    num_blocks: int
    num_free: int
    num_cached: int  # registered blocks (free or used): what the index should hold


class BlockPool:
    """Fixed set of KV blocks on one device.

    Invariants (checked by `check_invariants`):
      * a block is on the free queue iff its ref_count == 0
      * num_free + num_used == num_blocks
      * hash_to_block[h] == b iff block_hash[b] == h (every registered block, free or used)
      * a free block keeps its hash (still matchable) until it is reallocated
    """

    def __init__(self, num_blocks: int, clock: Callable[[], float]) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._clock = clock
        self._ref_count = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._last_use = [0.0] * num_blocks
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        # Insertion order is eviction order: the first key is handed out first.
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(b), None) for b in range(num_blocks)
        )
        self._pending_events: list[KVEvent] = []
        # Registered blocks handed out again since the last drain: their KV is about to be
        # overwritten, so a host tier must copy them out first.
        self._evicted: list[tuple[BlockId, BlockHash]] = []
        self.num_evicted = 0
        """Registered blocks handed out again since start (their hash dropped): evictions."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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

    def acquire(self, blocks: Sequence[BlockId]) -> None:
        """Take a reference on blocks returned by `match_prefix` (they may be free or in use)."""
        now = self._clock()
        for b in blocks:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1
            self._last_use[b] = now

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Fresh blocks with ref_count 1, evicting the least recently freed; None if too few."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None  # expected: the scheduler waits or preempts
        now = self._clock()
        blocks: list[BlockId] = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            h = self._block_hash[b]
            if h is not None:
                del self._hash_to_block[h]
                self._block_hash[b] = None
                evicted.append(h)
                self._evicted.append((b, h))
                self.num_evicted += 1
            self._ref_count[b] = 1
            self._last_use[b] = now
            blocks.append(b)
        if evicted:
            self._pending_events.append(BlockRemoved(tuple(evicted)))
        return blocks

    def register(self, block: BlockId, block_hash: BlockHash, parent: BlockHash) -> bool:
        """Make a fully written, referenced block matchable; False if the hash is already held."""
        if self._ref_count[block] == 0:
            raise ValueError(f"block {block} is free; register it before freeing it")
        current = self._block_hash[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block} already holds hash {current:#x}")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._block_hash[block] = block_hash
        self._hash_to_block[block_hash] = block
        self._append_stored(block_hash, parent)
        return True

    def free(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference from each block of a sequence, given in sequence order.

        Blocks reaching ref_count 0 join the free queue tail first, so the root of a chain is the
        last of them to be evicted; unregistered blocks go to the head, to be reused first.
        """
        now = self._clock()
        for b in reversed(blocks):
            if self._ref_count[b] <= 0:
                raise ValueError(f"block {b} freed more often than acquired")
            self._ref_count[b] -= 1
            self._last_use[b] = now
            if self._ref_count[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)

    def evict_all_free(self) -> int:
        """Forget the hashes of every free block (ClearCache); returns how many were dropped."""
        dropped: list[BlockHash] = []
        for b in self._free:
            h = self._block_hash[b]
            if h is not None:
                del self._hash_to_block[h]
                self._block_hash[b] = None
                dropped.append(h)
        if dropped:
            self._pending_events.append(BlockRemoved(tuple(dropped)))
        return len(dropped)

    def drain_evicted(self) -> list[tuple[BlockId, BlockHash]]:
        """(block, hash) of every registered block reallocated since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def drain_events(self) -> list[KVEvent]:
        events, self._pending_events = self._pending_events, []
        return events

    def _append_stored(self, block_hash: BlockHash, parent: BlockHash) -> None:
        # Coalesce consecutive registrations of one chain into a single event.
        last = self._pending_events[-1] if self._pending_events else None
        if isinstance(last, BlockStored) and last.hashes[-1] == parent:
            self._pending_events[-1] = BlockStored(
                last.hashes + (block_hash,), last.tier, last.parent_hash
            )
        else:
            self._pending_events.append(BlockStored((block_hash,), parent_hash=parent))

    def check_invariants(self) -> None:
        num_used = 0
        for b in range(self.num_blocks):
            block = BlockId(b)
            rc = self._ref_count[block]
            assert rc >= 0, f"block {b} has ref_count {rc}"
            assert (rc == 0) == (block in self._free), f"block {b}: ref {rc}, free-queue mismatch"
            num_used += rc > 0
            h = self._block_hash[block]
            if h is not None:
                assert self._hash_to_block.get(h) == block, (
                    f"block {b}: hash {h:#x} not mapped back"
                )
        assert num_used + len(self._free) == self.num_blocks
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash {h:#x} maps to block {b} holding another hash"
