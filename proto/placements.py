"""Placements: the entries of the fleet-wide decision log that coordinator replicas share.

Every routing decision of a replica running with the decision log is committed to one ordered
log in Redis (`coordinator/index/decision_stream.py`); every replica applies the log's entries
in order to its load tracker and its policy state, so all replicas hold the state one
coordinator would have built from the same decisions. An entry is what a replica needs to
replay the decision as if it had made it:

    {"v": 1, "r": request_id, "o": origin, "w": worker_id, "s": session_id,
     "n": prompt_len, "u": uncached_len, "p": predicted_prefill_ms,
     "h": new block hashes (8 bytes each, little-endian, concatenated),
     "q": blocks of the prompt the worker reuses (held or pulled), "l": the last of them}

`new block hashes` are the prompt's blocks the worker does not hold yet by the index (those the
policy counts as routed to it until the index confirms them). The log's sequence number is not
in the entry: the log assigns it (the stream entry id `<seq>-0`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import numpy as np

from kvmesh.proto.block_hash import BlockHash

PLACEMENT_VERSION = 1
_MAX_ID_LEN = 256
_U32_MAX = (1 << 32) - 1


class PlacementDecodeError(ValueError):
    """An entry that does not follow the schema; it is skipped and counted."""


@dataclass(frozen=True, slots=True)
class Placement:
    """One committed routing decision."""

    request_id: str
    origin: str
    """The replica that decided it (`Coordinator.origin`)."""
    worker_id: str
    session_id: str
    prompt_len: int
    """Prompt tokens."""
    uncached_len: int
    """Prompt tokens the worker must compute, as the deciding replica predicted (after a pull)."""
    predicted_prefill_ms: float
    """What the load tracker queues on the worker, and the policy's recent work."""
    new_hashes: tuple[BlockHash, ...] = ()
    """Prompt blocks routed to the worker beyond what the index showed it holding."""
    num_reused_blocks: int = 0
    """Leading prompt blocks the worker reuses (held, or pulled for it): the policy's reused
    prefixes, which price what a copy onto that worker would displace."""
    last_reused_hash: BlockHash = BlockHash(0)
    """The last of those blocks' hash (0 when none)."""

    def __post_init__(self) -> None:
        if not 0 <= self.uncached_len <= self.prompt_len:
            raise ValueError(
                f"uncached_len must be in [0, prompt_len={self.prompt_len}],"
                f" got {self.uncached_len}"
            )
        if not self.predicted_prefill_ms >= 0:
            raise ValueError(f"predicted_prefill_ms must be >= 0, got {self.predicted_prefill_ms}")


def encode_placement(p: Placement) -> bytes:
    hashes = np.asarray(p.new_hashes, dtype="<u8").tobytes()
    payload = {
        "v": PLACEMENT_VERSION,
        "r": p.request_id,
        "o": p.origin,
        "w": p.worker_id,
        "s": p.session_id,
        "n": p.prompt_len,
        "u": p.uncached_len,
        "p": float(p.predicted_prefill_ms),
        "h": hashes,
        "q": p.num_reused_blocks,
        "l": int(p.last_reused_hash),
    }
    return msgpack.packb(payload, use_bin_type=True)


def decode_placement(data: bytes) -> Placement:
    """Parse and validate one entry; raises PlacementDecodeError on anything off-schema."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise PlacementDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != PLACEMENT_VERSION:
        raise PlacementDecodeError("not a v1 placement")
    ids = [obj.get(k) for k in ("r", "o", "w", "s")]
    if not all(_is_id(x) for x in ids) or not ids[0] or not ids[2]:
        raise PlacementDecodeError(f"bad ids {ids!r}")
    rid, origin, worker, session = (cast(str, x) for x in ids)
    n, u, ms, raw = obj.get("n"), obj.get("u"), obj.get("p"), obj.get("h", b"")
    if not (_is_u32(n) and _is_u32(u)) or not isinstance(ms, float):
        raise PlacementDecodeError(f"bad sizes n={n!r} u={u!r} p={ms!r}")
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise PlacementDecodeError("h must be bytes, 8 per hash")
    hashes = _hashes(np.frombuffer(raw, dtype="<u8").tolist())
    reused, last = obj.get("q", 0), obj.get("l", 0)
    if not _is_u32(reused) or not isinstance(last, int) or not 0 <= last < 1 << 64:
        raise PlacementDecodeError(f"bad reused prefix q={reused!r} l={last!r}")
    try:
        return Placement(
            rid, origin, worker, session, cast(int, n), cast(int, u), ms, hashes,
            cast(int, reused), BlockHash(last),
        )  # fmt: skip
    except ValueError as exc:
        raise PlacementDecodeError(str(exc)) from None


def _hashes(values: Sequence[int]) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(v) for v in values)


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_ID_LEN


def _is_u32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U32_MAX
