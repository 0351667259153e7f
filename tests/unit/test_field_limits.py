"""Every string and repeated field of every request message has a limit, refused past it."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kvmesh.coordinator.service.field_limits import FieldLimits
from kvmesh.proto import kvmesh_pb2 as pb

LIMITS = FieldLimits(max_prompt_tokens=100)
REQUESTS = [m.input_type for m in pb.DESCRIPTOR.services_by_name["KVMesh"].methods]


def _bounded_fields(descriptor: Descriptor, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths to every string, bytes or repeated field, through nested messages."""
    out = []
    for field in descriptor.fields:
        here = (*path, field.name)
        if field.is_repeated or field.type in (
            FieldDescriptor.TYPE_STRING,
            FieldDescriptor.TYPE_BYTES,
        ):
            out.append(here)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            out += _bounded_fields(field.message_type, here)
    return out


CASES = [(d.name, p) for d in REQUESTS for p in _bounded_fields(d)]


def _message_with(descriptor: Descriptor, path: tuple[str, ...], size: int) -> Message:
    message: Message = getattr(pb, descriptor.name)()
    target = message
    for name in path[:-1]:
        target = getattr(target, name)
    field = target.DESCRIPTOR.fields_by_name[path[-1]]
    if field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE:
        for _ in range(size):
            getattr(target, path[-1]).add()
    elif field.is_repeated:
        getattr(target, path[-1]).extend([1] * size)
    elif field.type == FieldDescriptor.TYPE_BYTES:
        setattr(target, path[-1], b"x" * size)
    else:
        setattr(target, path[-1], "é" * (size // 2) + "x" * (size % 2))  # bytes, not characters
    return message


def test_the_service_has_requests_with_bounded_fields() -> None:
    names = {".".join((m, *p)) for m, p in CASES}
    assert {"GenerateRequest.request_id", "GenerateRequest.sampling.stop_token_ids"} <= names
    assert "DrainRequest.worker_id" in names and "RouteRequest.session_id" in names


@pytest.mark.parametrize(("message", "path"), CASES, ids=[".".join((m, *p)) for m, p in CASES])
def test_every_field_is_refused_one_past_its_limit_and_served_at_it(
    message: str, path: tuple[str, ...]
) -> None:
    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    limit = LIMITS.limit_of(path[-1])
    if limit < 0:
        leaf = descriptor
        for name in path[:-1]:
            leaf = leaf.fields_by_name[name].message_type
        repeated = leaf.fields_by_name[path[-1]].is_repeated
        limit = LIMITS.max_other_entries if repeated else LIMITS.max_other_bytes
    assert LIMITS.problem(_message_with(descriptor, path, limit)) is None
    problem = LIMITS.problem(_message_with(descriptor, path, limit + 1))
    assert problem is not None and f".{path[-1]} " in problem and str(limit) in problem
    assert "xx" not in problem and "é" not in problem  # never the value


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_id_bytes must be >= 1, got 0"):
        FieldLimits(max_id_bytes=0)
