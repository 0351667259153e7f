"""Byte and entry limits on every string and repeated field of a request.

Checked by the gate (`service/interceptor.py`) right after a request parses, before anything is
hashed, stored, routed or echoed: a client cannot make the coordinator or a worker keep (or copy
into every response) more than these bounds, whatever the 16 MiB message limit lets through.

    request_id, worker_id        max_id_bytes           ids: echoed in responses and errors
    session_id, cache_salt       max_key_bytes          kept in the session map / hashed
    prompt (text)                max_prompt_tokens * prompt_bytes_per_token
    token_ids                    max_prompt_tokens entries
    stop_token_ids               max_stop_token_ids entries
    any other string / repeated  max_other_bytes / max_other_entries

Messages name the field and the numbers, never the value. Pure: protobuf messages in, a reason
out; no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


@dataclass(frozen=True, slots=True)
class FieldLimits:
    max_id_bytes: int = 128
    """request_id and worker_id, in UTF-8 bytes."""
    max_key_bytes: int = 256
    """session_id and cache_salt, in UTF-8 bytes."""
    max_prompt_tokens: int = 1 << 17
    """Entries of token_ids (the coordinator passes max_prompt_tokens or the model's context)."""
    prompt_bytes_per_token: int = 16
    """A text prompt may have this many UTF-8 bytes per token of max_prompt_tokens."""
    max_stop_token_ids: int = 64
    """Entries of stop_token_ids."""
    max_other_bytes: int = 256
    """Any other string field of a request."""
    max_other_entries: int = 1024
    """Any other repeated field of a request."""

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def limit_of(self, field: str) -> int:
        """The limit of a field by name: bytes for a string, entries for a repeated field."""
        if field in ("request_id", "worker_id"):
            return self.max_id_bytes
        if field in ("session_id", "cache_salt"):
            return self.max_key_bytes
        if field == "prompt":
            return self.max_prompt_tokens * self.prompt_bytes_per_token
        if field == "token_ids":
            return self.max_prompt_tokens
        if field == "stop_token_ids":
            return self.max_stop_token_ids
        return -1  # the default of the field's kind

    def problem(self, message: Message) -> str | None:
        """Why `message` is over a limit (field, size, limit), or None if it is within all."""
        for field, value in message.ListFields():  # only the fields that are set
            name = f"{message.DESCRIPTOR.name}.{field.name}"
            limit = self.limit_of(field.name)
            if _is_repeated(field):
                limit = limit if limit > 0 else self.max_other_entries
                if len(value) > limit:
                    return f"{name} has {len(value)} entries, over the limit of {limit}"
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = next((p for p in map(self.problem, value) if p), None)
                    if found:
                        return found
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = self.problem(value)
                if found:
                    return found
            elif field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                limit = limit if limit > 0 else self.max_other_bytes
                size = _num_bytes(value)
                if size > limit:
                    return f"{name} is {size} bytes, over the limit of {limit} bytes"
        return None


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _num_bytes(value: str | bytes) -> int:
    return len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
