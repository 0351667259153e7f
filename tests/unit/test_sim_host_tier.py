from __future__ import annotations

from kvmesh.coordinator.sim.host_tier import SimHostTier
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, BlockRemoved, BlockStored


def H(i: int) -> BlockHash:
    return BlockHash(100 + i)


def test_host_tier_keeps_the_most_recent_blocks_and_reports_them() -> None:
    host = SimHostTier(3)
    host.put([H(0), H(1), H(2)])
    assert host.match([H(0), H(1), H(5)]) == 2  # H(0), H(1) now recently used
    host.put([H(3)])  # evicts H(2), the least recently used
    host.check_invariants()
    assert host.match([H(2)]) == 0 and host.match([H(0), H(1)]) == 2
    events = host.drain_events()
    assert events[0] == BlockStored((H(0), H(1), H(2)), TIER_HOST)
    assert events[1] == BlockRemoved((H(2),), TIER_HOST)
    assert events[2] == BlockStored((H(3),), TIER_HOST)
