"""A simulated worker's host-memory tier: the hashes of the blocks its device pool gave up.

The live tier (`workers/kv/host_pool.py`) holds the KV itself; here only which hashes are held
matters, in the same LRU order and with the same KV events (tier host), so the index and the
router see the tier as they would live. A hit is priced as a host-to-device copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, BlockRemoved, BlockStored, KVEvent


class SimHostTier:
    """Invariant: len(held) <= num_blocks; LRU order is the OrderedDict's (first goes first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._held: OrderedDict[BlockHash, None] = OrderedDict()
        self._events: list[KVEvent] = []

    @property
    def num_cached(self) -> int:
        return len(self._held)

    def put(self, hashes: Sequence[BlockHash]) -> None:
        """Catch blocks the device evicted, evicting the least recently used beyond capacity."""
        stored, removed = [], []
        for h in hashes:
            if h in self._held:
                self._held.move_to_end(h)
                continue
            if len(self._held) >= self.num_blocks:
                victim, _ = self._held.popitem(last=False)
                removed.append(victim)
            self._held[h] = None
            stored.append(h)
        if removed:
            self._events.append(BlockRemoved(tuple(removed), TIER_HOST))
        if stored:
            self._events.append(BlockStored(tuple(stored), TIER_HOST))

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading hashes held; they count as used now (a promotion reads them)."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            self._held.move_to_end(h)
            n += 1
        return n

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        assert len(self._held) <= self.num_blocks
