"""Same-GPU pulls: the source pins its run, the target copies straight out of the source's cache
(mapped once per peer through CUDA IPC) with the block-copy kernel; no staging, no host trip. The
request is queued as soon as the copy is enqueued (its forward follows on the same stream); the
source unpins once the GPU has passed the copy."""

from __future__ import annotations

import asyncio

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.pull_admission import PullTargets
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import copy_blocks
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine


class CudaIpcTransport:
    """Invariant: a peer's cache is mapped at most once (`_mapped`) and only read while the
    peer holds pins on the blocks read."""

    def __init__(self, peers: PeerLookup, runner: ModelRunner) -> None:
        self._peers = peers
        self._runner = runner
        self._mapped: dict[str, torch.Tensor] = {}

    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        peer = self._peers(source)
        if source not in self._mapped:
            handle = await peer.ipc_handle()
            if handle is None:
                return None  # the peer's cache is not on a GPU
            rebuild, args = handle
            self._mapped[source] = rebuild(*args)
        peer_cache = self._mapped[source]
        ids = await peer.pin(hashes)
        copied: list[torch.cuda.Event] = []
        try:

            def fill(targets: PullTargets) -> int:
                n = targets.fillable(len(ids))
                if n:
                    ours = self._runner.kv_cache
                    check_same_layout(ours, peer_cache)
                    dst = [int(b) for b in targets.blocks[:n]]
                    copy_blocks(ours, dst, peer_cache, ids[targets.first : targets.first + n])
                    # The request's forward runs after the copy on this stream; only the
                    # peer's unpin has to wait for it, not the request.
                    done = torch.cuda.Event()
                    done.record()
                    copied.append(done)
                return n

            return await write(fill)
        finally:
            if ids:
                for done in copied:
                    await until_done(done)
                await peer.unpin(ids)


async def until_done(event: torch.cuda.Event, poll_s: float = 0.0005) -> None:
    """Wait, without holding the event loop, for the GPU to pass `event`."""
    while not event.query():
        await asyncio.sleep(poll_s)


def check_same_layout(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Caches may differ in block count only."""
    if theirs.shape[:2] != ours.shape[:2] or theirs.shape[3:] != ours.shape[3:]:
        raise ValueError(
            f"peer cache {tuple(theirs.shape)} does not match ours {tuple(ours.shape)}"
        )
    if theirs.dtype != ours.dtype:
        raise ValueError(f"peer cache is {theirs.dtype}, ours {ours.dtype}")
