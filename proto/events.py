"""The KV-event schema: what a worker tells the index about its pool, as msgpack batches.

A batch is one scheduler step's worth of events from one worker:

    {"v": 1, "w": worker_id, "g": generation, "s": seq, "t": unix_ms, "e": [event, ...]}

    event = [KIND_STORED,  [hash, ...], tier, parent_hash, depth]   blocks became matchable
                                                                    (chain order)
          | [KIND_REMOVED, [hash, ...], tier]                 blocks left the pool
          | [KIND_CLEARED]                                    the worker dropped everything

`seq` counts batches per worker and generation, from 1, with no gaps: a follower that sees a gap
(or a new generation) reloads that worker's full set. `generation` changes whenever the worker
(re)starts or clears its cache. Hashes are uint64. `parent_hash` is the hash before the first stored
block (0 when unknown), `depth` the depth of the first stored block (1 for a prompt's first
block, 0 when unknown; the others follow it in chain order): both are kept as radix metadata.
A stored event without `depth` (four fields, as older writers send) has depth 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvmesh.proto.block_hash import BlockHash

SCHEMA_VERSION = 1
KIND_STORED = 0
KIND_REMOVED = 1
KIND_CLEARED = 2

TIER_DEVICE = 0
TIER_HOST = 1

_U64_MAX = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A batch that does not follow the schema; it is rejected and counted, never applied."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[BlockHash, ...]
    tier: int = TIER_DEVICE
    parent_hash: BlockHash = BlockHash(0)
    depth: int = 0
    """Depth of hashes[0] (1: the first block after the root); 0 when unknown."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[BlockHash, ...]
    tier: int = TIER_DEVICE


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    worker_id: str
    generation: int
    seq: int
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    unix_ms: int = 0

    @property
    def num_block_events(self) -> int:
        return sum(len(e.hashes) for e in self.events if not isinstance(e, AllCleared))


def encode_batch(batch: EventBatch) -> bytes:
    events: list[list[Any]] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            stored = [KIND_STORED, [int(h) for h in e.hashes], e.tier, int(e.parent_hash)]
            events.append(stored + [e.depth] if e.depth else stored)  # v1's 4 fields if unknown
        elif isinstance(e, BlockRemoved):
            events.append([KIND_REMOVED, [int(h) for h in e.hashes], e.tier])
        else:
            events.append([KIND_CLEARED])
    payload = {
        "v": SCHEMA_VERSION,
        "w": batch.worker_id,
        "g": batch.generation,
        "s": batch.seq,
        "t": batch.unix_ms,
        "e": events,
    }
    return msgpack.packb(payload, use_bin_type=True)


def decode_batch(data: bytes) -> EventBatch:
    """Parse and validate one batch; raises EventDecodeError on anything off-schema."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
        raise EventDecodeError("not a v1 event batch")
    worker_id = obj.get("w")
    generation: Any = obj.get("g")
    seq: Any = obj.get("s")
    unix_ms: Any = obj.get("t", 0)
    raw_events = obj.get("e")
    if not isinstance(worker_id, str) or not worker_id:
        raise EventDecodeError("worker id must be a non-empty string")
    for name, value in (("generation", generation), ("seq", seq), ("t", unix_ms)):
        if not _is_u64(value):
            raise EventDecodeError(f"{name} must be a uint64, got {value!r}")
    if not isinstance(raw_events, list):
        raise EventDecodeError("events must be a list")
    events = tuple(_decode_event(e) for e in raw_events)
    return EventBatch(worker_id, generation, seq, events, unix_ms)  # validated above


def _decode_event(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw:
        raise EventDecodeError(f"event must be a non-empty list, got {raw!r}")
    kind = raw[0]
    if kind == KIND_CLEARED and len(raw) == 1:
        return AllCleared()
    if kind == KIND_STORED and len(raw) in (4, 5):
        hashes, tier, parent = raw[1], raw[2], raw[3]
        depth = raw[4] if len(raw) == 5 else 0
        if not _is_u64(parent):
            raise EventDecodeError("parent hash must be a uint64")
        if not _is_u64(depth):
            raise EventDecodeError("depth must be a uint64")
        return BlockStored(_decode_hashes(hashes), _decode_tier(tier), BlockHash(parent), depth)
    if kind == KIND_REMOVED and len(raw) == 3:
        return BlockRemoved(_decode_hashes(raw[1]), _decode_tier(raw[2]))
    raise EventDecodeError(f"unknown event {raw[:1]!r} with {len(raw)} fields")


def _decode_hashes(raw: Any) -> tuple[BlockHash, ...]:
    # The same test as `_is_u64` per hash, in C loops (a follower decodes every block): exact
    # ints only (not bools), then the range of the smallest and the largest.
    if not isinstance(raw, list) or (
        raw and (set(map(type, raw)) != {int} or min(raw) < 0 or max(raw) > _U64_MAX)
    ):
        raise EventDecodeError("hashes must be a list of uint64")
    return tuple(raw)  # BlockHash is a NewType of int: the ints are the hashes


def _decode_tier(raw: Any) -> int:
    if raw not in (TIER_DEVICE, TIER_HOST):
        raise EventDecodeError(f"unknown tier {raw!r}")
    return int(raw)


def _is_u64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64_MAX
