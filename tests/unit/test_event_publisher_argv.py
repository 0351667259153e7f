"""The event script's arguments a worker's publisher builds (pure: no Redis)."""

from __future__ import annotations

from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, BlockRemoved, BlockStored, EventBatch
from kvmesh.workers.engine.event_publisher import batch_to_argv

CHAIN = tuple(BlockHash(h) for h in (0xA0, 2**64 - 1, 0xC2))


def _groups(argv: list[str | bytes | int]) -> list[list[str | bytes | int]]:
    out, i = [], 8
    while i < len(argv):
        size = {"S": 6, "R": 3, "C": 1}[str(argv[i])]
        out.append(argv[i : i + size])
        i += size
    return out


def test_a_chain_with_parent_and_depth_goes_with_every_blocks_value() -> None:
    batch = EventBatch("w0", 1, 2, (BlockStored(CHAIN, TIER_HOST, BlockHash(0x77), 5),))
    argv = batch_to_argv("ns", batch, 100)
    assert argv[7] == ""  # nothing dropped, nothing to keep
    [(kind, tier, hashes, values, _parent, _depth)] = _groups(argv)
    assert (kind, tier) == ("S", "1")
    assert hashes == "".join(schema.hash_hex(h) for h in CHAIN).encode()
    parents = (0x77, *CHAIN[:-1])
    expected = "".join(schema.block_value(1, p, 5 + k) for k, p in enumerate(parents))
    assert values == expected.encode()


def test_a_store_without_its_link_is_left_to_the_script_which_keeps_dropped_links() -> None:
    unlinked = BlockStored(CHAIN[:1], TIER_HOST)
    no_depth = BlockStored(CHAIN[1:], parent_hash=BlockHash(0x77))
    too_deep = BlockStored(CHAIN, parent_hash=BlockHash(0x77), depth=schema.MAX_LINK_DEPTH)
    empty = BlockStored((), parent_hash=BlockHash(0x77), depth=1)
    events = (unlinked, no_depth, too_deep, empty)
    argv = batch_to_argv("ns", EventBatch("w0", 1, 2, events), 100)
    assert [g[3] for g in _groups(argv)] == [b"", b"", b"", b""]
    assert argv[7] == ""  # the batch drops nothing
    demotion = (BlockRemoved(CHAIN[:1]), unlinked)
    assert batch_to_argv("ns", EventBatch("w0", 1, 2, demotion), 100)[7] == "1"
    first_of_generation = EventBatch("w0", 2, 1, (unlinked,))
    assert batch_to_argv("ns", first_of_generation, 100)[7] == "1"
