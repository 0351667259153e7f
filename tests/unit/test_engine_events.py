"""vLLM's and SGLang's KV events, decoded from payloads vLLM's own classes produced (both
encodings: tests/fixtures/vllm_kv_events/make_payloads.py) and from hand-built SGLang and
malformed payloads."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from kvmesh.coordinator.engines import sglang_events, vllm_events
from kvmesh.coordinator.engines.engine_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineDecodeError,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_kv_events"


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_vllm_payloads_of_both_encodings_decode_to_the_same_events(encoding: str) -> None:
    batch = vllm_events.decode_payload((FIXTURES / f"{encoding}.msgpack").read_bytes())
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0 and batch.num_skipped == 0
    root, child, removed, cleared = batch.events
    assert isinstance(root, EngineBlockStored)
    assert root.block_hashes == (101, 102) and root.parent_hash is None
    assert root.token_ids == tuple(range(8)) and root.block_size == 4 and root.medium == "GPU"
    assert isinstance(child, EngineBlockStored)
    assert child.block_hashes == (b"\x01" * 32,) and child.parent_hash == 102
    assert child.extra_keys == (("image-1", 0),)
    assert removed == EngineBlockRemoved((b"\x01" * 32,), "GPU")
    assert cleared == EngineAllCleared()


def _batch(*events: object) -> bytes:
    return msgpack.packb([2.0, list(events), 0], use_bin_type=True)


def test_unknown_and_malformed_vllm_events_are_counted_and_skipped() -> None:
    good = {"type": "AllBlocksCleared"}
    payload = _batch(
        {"type": "BlockReused", "block_hashes": [1]},  # an event kind kvmesh does not know
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1.5], "token_ids": [0] * 4, "block_size": 4},
        ["BlockRemoved"],  # no hashes
        "garbage",
        good,
    )
    batch = vllm_events.decode_payload(payload)
    assert batch.events == (EngineAllCleared(),)
    assert batch.num_skipped == 5
    assert any("2 token ids for 1 blocks" in r for r in batch.skipped_reasons)


def test_newer_fields_are_ignored_and_remote_blocks_are_not_this_engines() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "session_id": "s",
        "future": [1],
    }
    remote = dict(stored, locality="REMOTE")  # fmt: skip
    batch = vllm_events.decode_payload(_batch(stored, remote))
    assert [e.block_hashes for e in batch.events] == [(5,)]  # type: ignore[union-attr]
    assert batch.num_skipped == 0


def test_a_payload_that_is_no_batch_raises() -> None:
    with pytest.raises(EngineDecodeError):
        vllm_events.decode_payload(b"\xc1 not msgpack")
    with pytest.raises(EngineDecodeError):
        vllm_events.decode_payload(msgpack.packb({"ts": "x", "events": 3}))


def test_sglang_positional_events_decode() -> None:
    payload = msgpack.packb(
        [3.0, [["BlockStored", [11, 12], None, list(range(8)), 4, None],
               ["BlockRemoved", [12]], ["AllBlocksCleared"], ["Nope"]]]
    )  # fmt: skip
    batch = sglang_events.decode_payload(payload)
    stored, removed, cleared = batch.events
    assert stored == EngineBlockStored((11, 12), None, tuple(range(8)), 4)
    assert removed == EngineBlockRemoved((12,))
    assert cleared == EngineAllCleared()
    assert batch.num_skipped == 1
