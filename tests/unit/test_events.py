from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
)

BATCH = EventBatch(
    "w0",
    7,
    3,
    (
        BlockStored((BlockHash(1), BlockHash(2**64 - 1)), 0, BlockHash(5)),
        BlockRemoved((BlockHash(9),), 1),
        AllCleared(),
    ),
    1700000000000,
)
PINNED = (
    "86a17601a177a27730a16707a17303a174cf0000018bcfe56800a1659394009201cfffffffffffffffff"
    "000593019109019102"
)


def test_encoding_matches_pinned_vector() -> None:
    assert encode_batch(BATCH).hex() == PINNED
    assert decode_batch(bytes.fromhex(PINNED)) == BATCH


def test_counts_block_events() -> None:
    assert BATCH.num_block_events == 3


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 2, "w": "w", "g": 0, "s": 0, "e": []}),
        msgpack.packb({"v": 1, "w": "", "g": 0, "s": 0, "e": []}),
        msgpack.packb({"v": 1, "w": "w", "g": -1, "s": 0, "e": []}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[0, [1], 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[0, [-5], 0, 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[0, [1, True], 0, 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[0, [1, 2.0], 0, 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[1, [3, "4"], 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[1, [-1, 2**64 - 1], 0]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[1, [1], 7]]}),
        msgpack.packb({"v": 1, "w": "w", "g": 0, "s": 0, "e": [[9]]}),
        msgpack.packb({"v": 1, "w": "w", "g": True, "s": 0, "e": []}),
    ],
)
def test_malformed_batches_are_rejected(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        decode_batch(data)
    except EventDecodeError:
        pass


u64 = st.integers(min_value=0, max_value=2**64 - 1)
events = st.one_of(
    st.builds(
        lambda hs, t, p: BlockStored(tuple(hs), t, p),
        st.lists(u64, max_size=5),
        st.sampled_from([0, 1]),
        u64,
    ),
    st.builds(
        lambda hs, t: BlockRemoved(tuple(hs), t), st.lists(u64, max_size=5), st.sampled_from([0, 1])
    ),
    st.just(AllCleared()),
)


@given(st.text(min_size=1, max_size=8), u64, u64, st.lists(events, max_size=6))
def test_round_trip(worker: str, generation: int, seq: int, evs: list) -> None:
    batch = EventBatch(worker, generation, seq, tuple(evs), 0)
    assert decode_batch(encode_batch(batch)) == batch


def test_stored_depth_round_trips_and_four_field_stored_events_have_depth_zero() -> None:
    with_depth = EventBatch("w0", 1, 1, (BlockStored((BlockHash(3),), 0, BlockHash(2), 4),))
    assert decode_batch(encode_batch(with_depth)) == with_depth
    old = msgpack.packb(
        {"v": 1, "w": "w0", "g": 1, "s": 1, "t": 0, "e": [[0, [3], 0, 2]]}, use_bin_type=True
    )
    assert decode_batch(old).events == (BlockStored((BlockHash(3),), 0, BlockHash(2), 0),)
    bad = msgpack.packb(
        {"v": 1, "w": "w0", "g": 1, "s": 1, "t": 0, "e": [[0, [3], 0, 2, -1]]}, use_bin_type=True
    )
    with pytest.raises(EventDecodeError, match="depth"):
        decode_batch(bad)
