"""Helpers of the index tests that talk to Redis directly: stored events, and a follower that
has rebuilt its mirror from Redis and drains the streams on demand."""

from __future__ import annotations

from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockStored


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(BlockHash(h) for h in hashes))


def follower_for(url: str, ns: str) -> IndexFollower:
    follower = IndexFollower(IndexStore(url), LockedMirror(), ns=ns)
    follower.rebuild()
    return follower


def drain(follower: IndexFollower) -> None:
    while follower.poll_once(block_ms=None):
        pass
