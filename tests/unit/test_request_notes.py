"""Request notes: the wire format workers and coordinators append to the shard streams."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.proto.request_notes import (
    NoteBatch,
    NoteDecodeError,
    RequestFinished,
    RequestPrefilled,
    RequestTaken,
    decode_notes,
    encode_notes,
)
from kvmesh.workers.engine.note_log import NoteLog


def test_a_batch_round_trips() -> None:
    batch = NoteBatch(
        "w3",
        (RequestTaken("r1", "c0", 120, 40), RequestPrefilled("r1"), RequestFinished("r1")),
        1_700_000_000_000,
    )
    assert decode_notes(encode_notes(batch)) == batch


def test_uncached_tokens_cannot_exceed_the_prompt() -> None:
    with pytest.raises(ValueError, match="uncached_len must be in"):
        RequestTaken("r1", "c0", 10, 11)


@pytest.mark.parametrize(
    "payload",
    [
        {"v": 2, "w": "w0", "t": 0, "n": []},
        {"v": 1, "w": "", "t": 0, "n": []},
        {"v": 1, "w": "w0", "t": -1, "n": []},
        {"v": 1, "w": "w0", "t": 0, "n": [[0, "r1", "c0", 10]]},
        {"v": 1, "w": "w0", "t": 0, "n": [[0, "r1", "c0", 10, 11]]},
        {"v": 1, "w": "w0", "t": 0, "n": [[7, "r1"]]},
        {"v": 1, "w": "w0", "t": 0, "n": [[1]]},
        {"v": 1, "w": "w0", "t": 0, "n": [[1, 5]]},
    ],
)
def test_off_schema_batches_are_refused(payload: dict[str, object]) -> None:
    with pytest.raises(NoteDecodeError):
        decode_notes(msgpack.packb(payload))


def test_garbage_is_refused() -> None:
    with pytest.raises(NoteDecodeError, match="not msgpack"):
        decode_notes(b"\xc1")


def test_the_log_drains_its_notes_in_order_once() -> None:
    log = NoteLog("w0", wall_ns=lambda: 5_000_000)
    assert log.drain() is None
    log.taken("r1", "c0", 32, 16)
    log.prefilled("r1")
    log.finished("r1")
    batch = log.drain()
    assert batch == NoteBatch(
        "w0",
        (RequestTaken("r1", "c0", 32, 16), RequestPrefilled("r1"), RequestFinished("r1")),
        5,
    )
    assert log.drain() is None
