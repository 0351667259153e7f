"""SGLang's KV events (`sglang/srt/disaggregation/kv_events.py`) as engine events.

The same ZMQ framing and replay as vLLM's, but always positional and with fewer fields:

    EventBatch        [ts, events, attn_dp_rank?]
    BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                       lora_id]
    BlockRemoved      ["BlockRemoved", block_hashes]
    AllBlocksCleared  ["AllBlocksCleared"]

Hashes are ints; SGLang's radix cache announces one page (`block_size` = its page size) or more
per event. Unknown or malformed events are skipped and counted, as for vLLM.
"""

from __future__ import annotations

from typing import Any

from kvmesh.coordinator.engines.engine_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineEvent,
    EngineEventBatch,
)
from kvmesh.coordinator.engines.vllm_events import (
    MalformedEvent,
    decode_hashes,
    positional_fields,
    stored_from_fields,
    unpack_batch,
)

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
REMOVED_FIELDS = ("block_hashes",)


def decode_payload(payload: bytes) -> EngineEventBatch:
    """One ZMQ payload frame -> its batch; raises EngineDecodeError when it is not a batch."""
    return unpack_batch(payload, decode_event)


def decode_event(raw: Any) -> EngineEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MalformedEvent(f"an SGLang event is a tagged array, got {type(raw).__name__}")
    tag = raw[0]
    if tag == "BlockStored":
        return stored_from_fields(positional_fields(raw[1:], STORED_FIELDS))
    if tag == "BlockRemoved":
        return EngineBlockRemoved(
            decode_hashes(positional_fields(raw[1:], REMOVED_FIELDS).get("block_hashes"))
        )
    if tag == "AllBlocksCleared":
        return EngineAllCleared()
    raise MalformedEvent(f"unknown event type {tag!r}")
