"""Request notes: what a worker tells every coordinator about the requests it serves.

Coordinator replicas route over one fleet; each knows at once what it routed itself, and learns
what the others routed from these notes, which the worker appends to its shard's event stream
(field "r", beside the KV-event batches) after the step that saw the change:

    {"v": 1, "w": worker_id, "t": unix_ms, "n": [note, ...]}

    note = [KIND_TAKEN, request_id, origin, prompt_len, uncached_len]   the worker accepted it
         | [KIND_PREFILLED, request_id]                                its first token is out
         | [KIND_FINISHED, request_id]                                 it left the worker

`origin` is the id of the coordinator that routed the request (`WorkerRequest.origin`), so that
coordinator skips its own. `uncached_len` is the prompt tokens the worker must compute: the
prompt less what its pool holds, or will hold once a planned pull lands, when it accepted it.
Notes are hints with no sequence numbers: a lost note costs a replica some accuracy until its
next report (and a taken request it never hears the end of expires), never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

NOTES_VERSION = 1
KIND_TAKEN = 0
KIND_PREFILLED = 1
KIND_FINISHED = 2

_MAX_ID_LEN = 256
_U32_MAX = (1 << 32) - 1


class NoteDecodeError(ValueError):
    """A note batch that does not follow the schema; it is dropped and counted."""


@dataclass(frozen=True, slots=True)
class RequestTaken:
    request_id: str
    origin: str
    """The coordinator that routed it (empty: unknown)."""
    prompt_len: int
    """Prompt tokens."""
    uncached_len: int
    """Prompt tokens the worker has to compute (0 <= uncached_len <= prompt_len)."""

    def __post_init__(self) -> None:
        if not 0 <= self.uncached_len <= self.prompt_len:
            raise ValueError(
                f"uncached_len must be in [0, prompt_len={self.prompt_len}],"
                f" got {self.uncached_len}"
            )


@dataclass(frozen=True, slots=True)
class RequestPrefilled:
    request_id: str


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str


RequestNote = RequestTaken | RequestPrefilled | RequestFinished


@dataclass(frozen=True, slots=True)
class NoteBatch:
    worker_id: str
    notes: tuple[RequestNote, ...] = field(default_factory=tuple)
    unix_ms: int = 0


def encode_notes(batch: NoteBatch) -> bytes:
    notes: list[list[Any]] = []
    for n in batch.notes:
        if isinstance(n, RequestTaken):
            notes.append([KIND_TAKEN, n.request_id, n.origin, n.prompt_len, n.uncached_len])
        elif isinstance(n, RequestPrefilled):
            notes.append([KIND_PREFILLED, n.request_id])
        else:
            notes.append([KIND_FINISHED, n.request_id])
    payload = {"v": NOTES_VERSION, "w": batch.worker_id, "t": batch.unix_ms, "n": notes}
    return msgpack.packb(payload, use_bin_type=True)


def decode_notes(data: bytes) -> NoteBatch:
    """Parse and validate one batch; raises NoteDecodeError on anything off-schema."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise NoteDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != NOTES_VERSION:
        raise NoteDecodeError("not a v1 note batch")
    worker_id, unix_ms, raw = obj.get("w"), obj.get("t", 0), obj.get("n")
    if not _is_id(worker_id) or not worker_id:
        raise NoteDecodeError("worker id must be a non-empty string")
    if not isinstance(unix_ms, int) or isinstance(unix_ms, bool) or unix_ms < 0:
        raise NoteDecodeError(f"t must be a non-negative int, got {unix_ms!r}")
    if not isinstance(raw, list):
        raise NoteDecodeError("notes must be a list")
    return NoteBatch(worker_id, tuple(_decode_note(n) for n in raw), unix_ms)


def _decode_note(raw: Any) -> RequestNote:
    if not isinstance(raw, list) or len(raw) < 2 or not _is_id(raw[1]):
        raise NoteDecodeError(f"a note is [kind, request_id, ...], got {raw!r}")
    kind = raw[0]
    if kind == KIND_TAKEN and len(raw) == 5:
        _, request_id, origin, prompt_len, uncached_len = raw
        if not _is_id(origin) or not (_is_u32(prompt_len) and _is_u32(uncached_len)):
            raise NoteDecodeError(f"bad taken note {raw!r}")
        try:
            return RequestTaken(request_id, origin, prompt_len, uncached_len)
        except ValueError as exc:
            raise NoteDecodeError(str(exc)) from None
    if kind == KIND_PREFILLED and len(raw) == 2:
        return RequestPrefilled(raw[1])
    if kind == KIND_FINISHED and len(raw) == 2:
        return RequestFinished(raw[1])
    raise NoteDecodeError(f"unknown note {raw[:1]!r} with {len(raw)} fields")


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_ID_LEN


def _is_u32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U32_MAX
