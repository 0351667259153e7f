"""An engine's block hashes -> kvmesh's chained block hashes, for one engine.

vLLM seeds its block hashes per process, so two engines holding the same prefix announce
different hashes, and none of them is kvmesh's. kvmesh recomputes its own chain from the tokens
each `BlockStored` carries, continuing from its parent's kvmesh hash (looked up here), and keeps
the map so a `BlockRemoved`, which names only engine hashes, finds its entries:

    engine:   p ──> e1 ──> e2          BlockStored(block_hashes=[e1, e2], parent=p, tokens)
    kvmesh:   m ──> k1 ──> k2          k1, k2 = block_hashes(tokens, block_size, parent=m)
    map:      p->m, e1->k1, e2->k2     (a chain starting a prompt has parent None: m = h_0)

The root h_0 is the coordinator's own for the event's LoRA name and cache salt (so a prompt the
coordinator hashes lands on the same chain). vLLM repeats both in its per-block extra keys (the
LoRA name on every block, the salt, a plain string, on the first): they are taken out there and
the remaining extra keys (multimodal ids, embedding digests) are hashed into their block, as
kvmesh's contract does. A block whose parent was never seen
(stored before kvmesh subscribed, or lost in a gap nobody could replay) cannot be chained and is
not indexed: routing then under-counts that engine's cache, it never over-counts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvmesh.coordinator.engines.engine_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EngineHash,
)
from kvmesh.proto.block_hash import BlockHash, block_hashes
from kvmesh.proto.events import (
    TIER_DEVICE,
    TIER_HOST,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

log = logging.getLogger(__name__)

_HOST_MEDIA = frozenset({"CPU", "cpu", "STORAGE", "host"})
"""Media below the engine's device cache (vLLM's offloading tiers): kvmesh's host tier."""


@dataclass(slots=True)
class TranslatorCounters:
    num_stored_blocks: int = 0
    num_removed_blocks: int = 0
    num_orphan_blocks: int = 0
    """Stored blocks whose parent was unknown (not indexed)."""
    num_unknown_removals: int = 0
    """Removed hashes never stored (or already removed): nothing to do."""
    num_wrong_block_size: int = 0
    """Stored events whose block size is not kvmesh's (not indexed: the chains cannot agree)."""
    num_other_groups: int = 0
    """Events of KV-cache groups other than 0 (hybrid models): not indexed."""


class ChainTranslator:
    """Turns one engine's events into kvmesh events.

    Invariants:
      * every engine hash in `_engine_to_kvmesh` was announced stored and not yet removed
      * `_num_refs[k]` is the number of engine hashes mapped to kvmesh hash k (> 0), so a kvmesh
        block leaves the index only when the last engine block behind it does
    """

    def __init__(self, block_size: int, root: Callable[[str, str], BlockHash]) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root = root
        """h_0 of the coordinator's chains for (LoRA name, cache salt); "" for none."""
        self._engine_to_kvmesh: dict[tuple[EngineHash, int], tuple[BlockHash, int]] = {}
        """(engine hash, tier) -> (kvmesh hash, tier): an engine that offloads to CPU announces
        the same hash once per medium."""
        self._num_refs: dict[tuple[BlockHash, int], int] = {}
        self.counters = TranslatorCounters()

    @property
    def num_blocks(self) -> int:
        """Distinct kvmesh blocks (per tier) this engine holds, as far as kvmesh knows."""
        return len(self._num_refs)

    def kvmesh_hash(self, engine_hash: EngineHash, tier: int = TIER_DEVICE) -> BlockHash | None:
        entry = self._engine_to_kvmesh.get((engine_hash, tier))
        return entry[0] if entry is not None else None

    def translate(self, event: EngineEvent) -> KVEvent | None:
        """The kvmesh event for one engine event; None when nothing in the index changes."""
        if isinstance(event, EngineAllCleared):
            self.clear()
            return AllCleared()
        if event.group_idx != 0:
            self.counters.num_other_groups += 1
            return None
        if isinstance(event, EngineBlockStored):
            return self._stored(event)
        return self._removed(event)

    def clear(self) -> None:
        self._engine_to_kvmesh.clear()
        self._num_refs.clear()

    def held(self) -> list[BlockStored]:
        """Everything held, as stored events (one per tier): a full re-publish after Redis lost
        the engine's entries."""
        by_tier: dict[int, list[BlockHash]] = {}
        for block, tier in self._num_refs:
            by_tier.setdefault(tier, []).append(block)
        return [BlockStored(tuple(hashes), tier) for tier, hashes in sorted(by_tier.items())]

    def _stored(self, event: EngineBlockStored) -> BlockStored | None:
        if event.block_size != self.block_size:
            if not self.counters.num_wrong_block_size:
                log.warning(
                    "engine announces blocks of %d tokens, kvmesh hashes blocks of %d: not"
                    " indexed (set --engine-block-size to the engine's block size)",
                    event.block_size,
                    self.block_size,
                )
            self.counters.num_wrong_block_size += 1
            return None
        extra_keys = list(event.extra_keys)
        if event.lora_name:  # in kvmesh's chain the adapter is in h_0, not in every block
            extra_keys = [_without(k, event.lora_name) for k in extra_keys]
        if event.parent_hash is None:
            salt = _salt(extra_keys[0]) if extra_keys else ""
            if salt:
                extra_keys[0] = _without(extra_keys[0], salt)
            parent = self._root(event.lora_name, salt)
        else:
            known = self._engine_to_kvmesh.get((event.parent_hash, TIER_DEVICE))
            known = known or self._engine_to_kvmesh.get((event.parent_hash, TIER_HOST))
            if known is None:
                self.counters.num_orphan_blocks += len(event.block_hashes)
                return None
            parent = known[0]
        extra = {i: extra_key_hashes(k) for i, k in enumerate(extra_keys) if k}
        hashes = block_hashes(event.token_ids, self.block_size, parent, extra or None)
        tier = tier_of(event.medium)
        for engine_hash, block in zip(event.block_hashes, hashes, strict=True):
            previous = self._engine_to_kvmesh.get((engine_hash, tier))
            if previous is not None:  # announced again: keep one reference
                self._unref(previous)
            self._engine_to_kvmesh[(engine_hash, tier)] = (block, tier)
            self._num_refs[(block, tier)] = self._num_refs.get((block, tier), 0) + 1
        self.counters.num_stored_blocks += len(hashes)
        root_parent = event.parent_hash is None
        return BlockStored(tuple(hashes), tier, BlockHash(0) if root_parent else parent)

    def _removed(self, event: EngineBlockRemoved) -> BlockRemoved | None:
        tier = tier_of(event.medium)
        gone: list[BlockHash] = []
        for engine_hash in event.block_hashes:
            entry = self._engine_to_kvmesh.pop((engine_hash, tier), None)
            if entry is None:
                self.counters.num_unknown_removals += 1
                continue
            if self._unref(entry):
                gone.append(entry[0])
        self.counters.num_removed_blocks += len(gone)
        return BlockRemoved(tuple(gone), tier) if gone else None

    def _unref(self, entry: tuple[BlockHash, int]) -> bool:
        """Drop one reference; True when it was the last."""
        n = self._num_refs[entry] - 1
        if n:
            self._num_refs[entry] = n
            return False
        del self._num_refs[entry]
        return True

    def check_invariants(self) -> None:
        counts: dict[tuple[BlockHash, int], int] = {}
        for entry in self._engine_to_kvmesh.values():
            counts[entry] = counts.get(entry, 0) + 1
        assert counts == self._num_refs, "reference counts disagree with the engine-hash map"


def _without(key: tuple[object, ...] | None, item: str) -> tuple[object, ...] | None:
    """A block's extra keys less its first `item` (None when nothing is left)."""
    if key is None or item not in key:
        return key
    i = key.index(item)
    rest = key[:i] + key[i + 1 :]
    return rest or None


def _salt(key: tuple[object, ...] | None) -> str:
    """The cache salt among a first block's extra keys: its one plain string (multimodal ids
    come as (id, offset) pairs, embedding digests as bytes)."""
    strings = [k for k in key or () if isinstance(k, str)]
    return strings[0] if len(strings) == 1 else ""


def tier_of(medium: str) -> int:
    """kvmesh's tier for an engine's medium: its device cache unless it names host memory."""
    return TIER_HOST if medium in _HOST_MEDIA else TIER_DEVICE


def extra_key_hashes(key: tuple[object, ...]) -> list[int]:
    """An engine's extra keys for one block as kvmesh's 64-bit extra keys: one stable hash per
    item (repr of str, int, bytes and tuples is the same in every process)."""
    return [xxhash.xxh3_64_intdigest(repr(item).encode("utf-8")) for item in key]
