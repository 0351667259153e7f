"""vLLM's KV events (`vllm/distributed/kv_events.py`), both encodings, as engine events.

A payload is an `EventBatch`, `[ts, events, data_parallel_rank]` (or the same as a map). Its
events are msgspec tagged structs, encoded one of two ways:

    positional (vLLM up to 0.23, SGLang):  ["BlockStored", block_hashes, parent_block_hash,
                                            token_ids, block_size, lora_id, medium, lora_name,
                                            extra_keys, group_idx, ...]
    map (later vLLM):                      {"type": "BlockStored", "block_hashes": [...], ...}

msgspec omits fields left at their defaults (trailing ones in the positional form), so a missing
field reads as its default. Fields this decoder does not know are ignored (newer engines add
them); a hash is an int or bytes. An event that is unknown or malformed is skipped and counted in
its batch; only a payload that is not a batch at all raises `EngineDecodeError`.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvmesh.coordinator.engines.engine_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineDecodeError,
    EngineEvent,
    EngineEventBatch,
    EngineHash,
)

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
"""BlockStored's fields in declaration order: the positional encoding's order."""
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
_TAG_KEY = "type"
_MAX_SKIP_REASONS = 4


class MalformedEvent(ValueError):
    """One event is off-schema: skip it."""


def decode_payload(payload: bytes) -> EngineEventBatch:
    """One ZMQ payload frame -> its batch; raises EngineDecodeError when it is not a batch."""
    return unpack_batch(payload, decode_event)


def unpack_batch(
    payload: bytes, decode_one: Callable[[Any], EngineEvent | None]
) -> EngineEventBatch:
    """A msgpack payload frame -> its batch, each event through `decode_one` (the batch framing
    is the same for every engine's schema)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise EngineDecodeError(f"not msgpack: {exc}") from None
    return decode_batch_object(obj, decode_one)


def decode_batch_object(
    obj: Any, decode_one: Callable[[Any], EngineEvent | None]
) -> EngineEventBatch:
    """`[ts, events, dp_rank]` or `{"ts", "events", "data_parallel_rank"}`, each event through
    `decode_one` (None: an event kvmesh has no use for, skipped without counting)."""
    if isinstance(obj, dict):
        ts, raw_events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, raw_events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise EngineDecodeError(f"not an event batch: {type(obj).__name__}")
    if not isinstance(ts, int | float) or not isinstance(raw_events, list):
        raise EngineDecodeError("an event batch needs a numeric ts and a list of events")
    events: list[EngineEvent] = []
    reasons: list[str] = []
    num_skipped = 0
    for raw in raw_events:
        try:
            event = decode_one(raw)
        except MalformedEvent as exc:
            num_skipped += 1
            if len(reasons) < _MAX_SKIP_REASONS:
                reasons.append(str(exc))
            continue
        if event is not None:
            events.append(event)
    rank_int = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
    return EngineEventBatch(float(ts), tuple(events), rank_int, num_skipped, tuple(reasons))


def decode_event(raw: Any) -> EngineEvent | None:
    """One vLLM event in either encoding; None for blocks another engine holds (locality
    REMOTE); raises MalformedEvent."""
    tag, fields = _tag_and_fields(raw)
    if fields.get("locality") == "REMOTE":
        return None
    if tag == "BlockStored":
        return stored_from_fields(fields)
    if tag == "BlockRemoved":
        return EngineBlockRemoved(
            decode_hashes(fields.get("block_hashes")),
            _opt_str(fields.get("medium"), "medium"),
            _opt_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return EngineAllCleared()
    raise MalformedEvent(f"unknown event type {tag!r}")


def _tag_and_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get(_TAG_KEY)
        if not isinstance(tag, str):
            raise MalformedEvent("a map-encoded event needs a string 'type'")
        return tag, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(raw[0], ())
        return raw[0], positional_fields(raw[1:], names)
    raise MalformedEvent(f"an event must be a tagged map or array, got {type(raw).__name__}")


def positional_fields(values: Sequence[Any], names: Sequence[str]) -> dict[str, Any]:
    """Name the values of a positional event (extra trailing values, from newer engines, are
    ignored; missing trailing ones read as their defaults)."""
    return dict(zip(names, values, strict=False))


def stored_from_fields(fields: dict[str, Any]) -> EngineBlockStored:
    hashes = decode_hashes(fields.get("block_hashes"))
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise MalformedEvent(f"block_size must be a positive int, got {block_size!r}")
    tokens = fields.get("token_ids")
    try:  # one C-level check of every id (a per-token Python check was 2/3 of decoding)
        if not isinstance(tokens, list):
            raise TypeError
        array.array("I", tokens)
    except (TypeError, OverflowError):
        raise MalformedEvent("token_ids must be a list of uint32") from None
    if len(tokens) != len(hashes) * block_size:
        raise MalformedEvent(
            f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size} tokens"
        )
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise MalformedEvent("extra_keys must be a list with one entry per block")
    return EngineBlockStored(
        hashes,
        None if parent is None else _hash(parent),
        tuple(tokens),
        block_size,
        _opt_str(fields.get("lora_name"), "lora_name"),
        _opt_str(fields.get("medium"), "medium"),
        tuple(None if k is None else tuple(_flat(k)) for k in extra or ()),
        _opt_int(fields.get("group_idx"), "group_idx"),
    )


def decode_hashes(raw: Any) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list) or not raw:
        raise MalformedEvent("block_hashes must be a non-empty list")
    return tuple(_hash(h) for h in raw)


def _hash(raw: Any) -> EngineHash:
    if isinstance(raw, bytes) or (isinstance(raw, int) and not isinstance(raw, bool)):
        return EngineHash(raw)
    raise MalformedEvent(f"a block hash must be an int or bytes, got {type(raw).__name__}")


def _opt_str(raw: Any, name: str) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise MalformedEvent(f"{name} must be a string, got {type(raw).__name__}")
    return raw


def _opt_int(raw: Any, name: str) -> int:
    if raw is None:
        return 0
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise MalformedEvent(f"{name} must be an int, got {type(raw).__name__}")
    return raw


def _flat(key: Any) -> list[object]:
    """An extra-keys entry as a list (msgpack gives tuples back as lists; a lone value is one)."""
    return list(key) if isinstance(key, list | tuple) else [key]
