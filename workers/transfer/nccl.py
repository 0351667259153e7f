"""GPU-to-GPU pulls over NCCL (one rank per GPU): the source pins and sends its run, the target
receives it into a staging tensor and copies it into the reserved blocks.

NCCL send/recv block both ranks until they pair up, so two workers pulling from each other at
once would wait on each other forever. A worker therefore takes part in one NCCL transfer at a
time, and a pull that finds either side busy is refused before anything is sent: the target
then uses the object store. No cycle of waits can form.
"""

from __future__ import annotations

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv.block_pool import BlockId
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import copy_blocks
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine


class NcclLink:
    """This worker's place in the NCCL group. Invariant: `busy` while a send or receive of this
    worker is agreed and not yet done; claimed and released on the actor's event loop only."""

    def __init__(self, rank: int, ranks: dict[str, int]) -> None:
        self.rank = rank
        self.ranks = dict(ranks)
        self.busy = False

    def try_claim(self) -> bool:
        if self.busy:
            return False
        self.busy = True
        return True

    def release(self) -> None:
        self.busy = False

    @staticmethod
    def send(cache: torch.Tensor, ids: list[int], dst_rank: int) -> None:
        """Stage the pinned blocks in cache layout with the copy kernel, send one tensor."""
        import torch.distributed as dist  # only multi-GPU deployments need it

        staging = cache.new_empty((*cache.shape[:2], len(ids), *cache.shape[3:]))
        copy_blocks(staging, list(range(len(ids))), cache, ids)
        dist.send(staging, dst=dst_rank)
        torch.cuda.synchronize()

    @staticmethod
    def recv_into(
        cache: torch.Tensor, targets: list[BlockId], num_blocks: int, src_rank: int
    ) -> int:
        """Receive `num_blocks` (always, so the sender completes) and keep the leading ones
        that fit `targets` (none if the request went away meanwhile)."""
        import torch.distributed as dist

        staging = cache.new_empty((*cache.shape[:2], num_blocks, *cache.shape[3:]))
        dist.recv(staging, src=src_rank)
        n = min(len(targets), num_blocks)
        if n:
            copy_blocks(cache, [int(b) for b in targets[:n]], staging, list(range(n)))
        torch.cuda.synchronize()
        return n


class NcclTransport:
    def __init__(self, peers: PeerLookup, runner: ModelRunner, link: NcclLink) -> None:
        self._peers = peers
        self._runner = runner
        self._link = link

    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        link = self._link
        if source not in link.ranks or not link.try_claim():
            return None
        try:
            peer = self._peers(source)
            ids: list[int] | None = await peer.nccl_accept.remote(list(hashes))
            if ids is None:
                return None  # the source is in another transfer
            if not ids:
                return 0
            send = peer.nccl_send.remote(ids, link.rank)
            src_rank = link.ranks[source]
            cache = self._runner.kv_cache

            def fill(targets: list[BlockId]) -> int:
                return NcclLink.recv_into(cache, targets, len(ids), src_rank)

            written = await write(fill)
            await send
            return written
        finally:
            link.release()
