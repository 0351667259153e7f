"""What an external engine says about its KV cache, once decoded from its own wire format.

Engine-neutral: the vLLM and SGLang decoders produce these; the chain translator turns them into
kvmesh's own events. An engine's block hashes are opaque to kvmesh (vLLM seeds them per process),
so they are kept as `EngineHash` (int or bytes, as the engine sent them), never mixed with
kvmesh's `BlockHash`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

EngineHash = NewType("EngineHash", object)
"""An engine's block hash: an int or bytes, hashable, meaningful only to that engine process."""


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """Blocks became reusable on the engine, in chain order. `token_ids` holds every token of
    every block (`len == len(block_hashes) * block_size`)."""

    block_hashes: tuple[EngineHash, ...]
    parent_hash: EngineHash | None
    """The engine's hash of the block before the first one; None when the chain starts at the
    beginning of a prompt."""
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    medium: str = ""
    """Where the blocks live on the engine ("GPU", "CPU", ...); empty when not said."""
    extra_keys: tuple[tuple[object, ...] | None, ...] = ()
    """Per block, what else the engine mixed into its hash (multimodal ids, salt); may be empty."""
    group_idx: int = 0
    """KV-cache group (hybrid models have several); kvmesh indexes group 0."""


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str = ""
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class EngineAllCleared:
    pass


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    """One published batch: its events that decoded, and how many did not."""

    ts: float
    events: tuple[EngineEvent, ...] = ()
    data_parallel_rank: int = 0
    num_skipped: int = 0
    """Events in the batch that were unknown or malformed (skipped, never applied)."""
    skipped_reasons: tuple[str, ...] = field(default_factory=tuple)


class EngineDecodeError(ValueError):
    """A whole payload is unreadable (not msgpack, not a batch); counted and skipped."""
