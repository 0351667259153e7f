"""Same-GPU pulls: the source pins its run, the target copies straight out of the source's cache
(mapped once per peer through CUDA IPC) with the block-copy kernel; no staging, no host trip."""

from __future__ import annotations

from typing import Any

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv.block_pool import BlockId
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
            handle: tuple[Any, Any] | None = await peer.ipc_handle.remote()
            if handle is None:
                return None  # the peer's cache is not on a GPU
            rebuild, args = handle
            self._mapped[source] = rebuild(*args)
        peer_cache = self._mapped[source]
        ids: list[int] = await peer.pin_blocks.remote(list(hashes))
        try:

            def fill(targets: list[BlockId]) -> int:
                n = min(len(targets), len(ids))
                if n:
                    ours = self._runner.kv_cache
                    check_same_layout(ours, peer_cache)
                    copy_blocks(ours, [int(b) for b in targets[:n]], peer_cache, ids[:n])
                    torch.cuda.synchronize(peer_cache.device)  # the peer unpins once we return
                return n

            return await write(fill)
        finally:
            if ids:
                peer.unpin_blocks.remote(ids)


def check_same_layout(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Caches may differ in block count only."""
    if theirs.shape[:2] != ours.shape[:2] or theirs.shape[3:] != ours.shape[3:]:
        raise ValueError(
            f"peer cache {tuple(theirs.shape)} does not match ours {tuple(ours.shape)}"
        )
    if theirs.dtype != ours.dtype:
        raise ValueError(f"peer cache is {theirs.dtype}, ours {ours.dtype}")
