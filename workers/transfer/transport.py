"""The interface every way of pulling KV from a peer implements, for the worker that pulls.

A transport runs on the pulling worker's event loop. It asks the source (`PeerSource`) for the
leading run of the plan's `hashes` it holds and hands a writer to `write`, which runs it on the
engine thread over the blocks the request reserved (see `kv/pull_reservation.py`; `PullTargets`
lines them up with the plan). The worker registers what was written; whatever a transport fails
to move is recomputed. `write` waits for the reservation, which the engine makes while the
source is being asked (the order of a pull: `puller.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.worker import BlockWriter
from kvmesh.workers.transfer.peer_source import PeerSource

WriteOnEngine = Callable[[BlockWriter], Awaitable[int]]
"""Runs a writer over the request's reserved blocks on the engine thread; returns its count."""

PeerLookup = Callable[[str], PeerSource]
"""Worker id -> the peer as a pull source (raises KeyError for an unknown peer)."""


class Transport(Protocol):
    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        """Move the leading run of `hashes` that `source` holds into the reserved blocks.
        Returns the blocks written, or None when this transport cannot run right now."""
        ...


async def fetch_planned(
    planned: Transport | None,
    object_store: Transport,
    source: str,
    hashes: tuple[BlockHash, ...],
    write: WriteOnEngine,
) -> int:
    """Blocks written by the transport the coordinator planned (None: the object store).

    A device link (NCCL, CUDA IPC) that cannot run right now means recompute, never the object
    store: the pull was priced at the link's speed, and an 8B model's 7.5K-token prefix is ~1 GB
    that the store would move through host memory in seconds, stalling both engines meanwhile
    (seen on two H100s: heartbeats lapsed under load), where recomputing it takes ~0.25 s.
    """
    if planned is not None:
        return await planned.fetch(source, hashes, write) or 0
    return await object_store.fetch(source, hashes, write) or 0
