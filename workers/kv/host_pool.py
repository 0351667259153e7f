"""The host-memory tier: pinned CPU slots that catch KV blocks evicted from the device pool.

A demoted block keeps its hash here, so a later prompt that misses on the device but hits here is
promoted back (one host-to-device copy) instead of recomputed. Slots are reused least recently
used first. The tensors are pinned when CUDA is present, so the copies overlap compute.

    device pool evicts block b (hash h) --export--> host slot s   (removed@device, stored@host)
    prompt misses h on the device, finds h here --> promote: copy s into a fresh device block

A block can also be copied here ahead of its eviction (`put(..., announce=False)`, while the
engine is idle): it is kept unannounced, since the device still holds it, and announced with no
copy when the device does evict it (`announce`). The index so only ever learns of a host copy
once it is the worker's only one, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, BlockRemoved, BlockStored, KVEvent


class HostPool:
    """Invariants: hash_to_slot and the free slots partition range(num_slots); LRU order is the
    OrderedDict's order (first = evicted first, skipping held slots); the unannounced hashes are
    a subset of hash_to_slot's."""

    def __init__(
        self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype, *, pin: bool
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self._hash_to_slot: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pending_events: list[KVEvent] = []
        self._unannounced: set[BlockHash] = set()
        self._held: set[int] = set()  # slots a device copy is still reading
        self.num_evicted = 0
        """Blocks dropped (least recently used first) to make room for others, since start."""

    @staticmethod
    def slots_for_bytes(num_bytes: int, block_shape: Sequence[int], dtype: torch.dtype) -> int:
        per_block = torch.Size(block_shape).numel() * torch.finfo(dtype).bits // 8
        return num_bytes // per_block

    @property
    def num_cached(self) -> int:
        """Announced blocks (the ones the index knows are here)."""
        return len(self._hash_to_slot) - len(self._unannounced)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._hash_to_slot

    def cached_hashes(self) -> list[BlockHash]:
        """Announced hashes, least recently used first."""
        return [h for h in self._hash_to_slot if h not in self._unannounced]

    def put(
        self, hashes: Sequence[BlockHash], blocks: torch.Tensor, *, announce: bool = True
    ) -> None:
        """Store blocks (layout of `BlockIO.export_blocks`) under their hashes, evicting LRU;
        a hash already here is only marked recently used (and announced, if asked)."""
        if blocks.shape[0] != len(hashes):
            raise ValueError(f"{blocks.shape[0]} blocks for {len(hashes)} hashes")
        for i, h in enumerate(hashes):
            if h in self._hash_to_slot:  # a hash names its KV: the copy here is that block
                continue
            slot = self._take_slot()
            if slot is None:
                continue
            self._hash_to_slot[h] = slot
            self._unannounced.add(h)
            self.data[slot].copy_(blocks[i], non_blocking=True)
        if announce:
            self.announce(hashes)
        else:
            self.touch(hashes)

    def announce(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the given hashes that are here recently used and make the unannounced ones
        known (a BlockStored event): the device no longer holds them."""
        self.touch(hashes)
        told = [h for h in hashes if h in self._unannounced]
        if told:
            self._unannounced.difference_update(told)
            self._pending_events.append(BlockStored(tuple(told), TIER_HOST))

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the given hashes that are here recently used (the others are ignored)."""
        for h in hashes:
            if h in self._hash_to_slot:
                self._hash_to_slot.move_to_end(h)

    def missing(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Positions in `hashes` of the blocks not here."""
        return [i for i, h in enumerate(hashes) if h not in self._hash_to_slot]

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes are here."""
        n = 0
        for h in hashes:
            if h not in self._hash_to_slot:
                break
            n += 1
        return n

    def slots_for(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots holding `hashes` (all must be present), marked recently used: for a reader
        that copies them itself (`LayerLoad`), holding them meanwhile (`hold`)."""
        slots = []
        for h in hashes:
            slots.append(self._hash_to_slot[h])
            self._hash_to_slot.move_to_end(h)
        return slots

    def hold(self, slots: Sequence[int]) -> None:
        """Keep `slots` from being reused (their contents are being read) until `release_held`."""
        self._held.update(slots)

    def release_held(self) -> None:
        self._held.clear()

    def get(self, hashes: Sequence[BlockHash], device: torch.device | str = "cpu") -> torch.Tensor:
        """The blocks for `hashes` (all must be present) on `device`, marked recently used.

        Copies go slot run by slot run straight from pinned memory, so a promotion to the GPU
        moves at PCIe speed instead of first gathering a pageable copy on the CPU.
        """
        slots = []
        for h in hashes:
            slots.append(self._hash_to_slot[h])
            self._hash_to_slot.move_to_end(h)
        out = torch.empty((len(slots), *self.data.shape[1:]), dtype=self.data.dtype, device=device)
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            out[i:j].copy_(self.data[slots[i] : slots[i] + (j - i)], non_blocking=True)
            i = j
        return out

    def drain_events(self) -> list[KVEvent]:
        events, self._pending_events = self._pending_events, []
        return events

    def clear(self) -> None:
        announced = self.cached_hashes()
        if announced:
            self._pending_events.append(BlockRemoved(tuple(announced), TIER_HOST))
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._hash_to_slot.clear()
        self._unannounced.clear()

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, s in self._hash_to_slot.items() if s not in self._held), None)
        if victim is None:
            return None  # every slot is being read: this block is not kept
        slot = self._hash_to_slot.pop(victim)
        self.num_evicted += 1
        if victim in self._unannounced:
            self._unannounced.discard(victim)  # never announced: nothing to take back
        else:
            self._pending_events.append(BlockRemoved((victim,), TIER_HOST))
        return slot

    def check_invariants(self) -> None:
        used = set(self._hash_to_slot.values())
        assert len(used) == len(self._hash_to_slot), "two hashes share a slot"
        assert used.isdisjoint(self._free_slots), "a used slot is on the free list"
        assert len(used) + len(self._free_slots) == self.num_slots
        assert self._unannounced <= self._hash_to_slot.keys(), "an unannounced hash has no slot"
