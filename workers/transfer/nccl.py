"""GPU-to-GPU pulls over NCCL (one rank per GPU): the source pins and sends its run, the target
receives it into a staging tensor and copies it into the reserved blocks. One call to the source
does both: `nccl_accept` pins the run, answers with its block ids and starts the send at once,
which completes when the target posts its receive.

NCCL send/recv block both ranks until they pair up, so two workers pulling from each other at
once would wait on each other forever. A worker therefore takes part in one NCCL transfer at a
time, and a pull that finds either side busy is refused before anything is sent; the target
lets go of its own claim, waits a moment and asks again, until `claim_wait_s` runs out (then it
uses the object store). Nobody waits while holding a claim, so no cycle of waits can form.

The first send/recv between two ranks builds their NCCL communicator (about a second); the
shell warms every pair up at start-up (`warm_up_pairs`) so no request pays for it.
"""

from __future__ import annotations

import asyncio

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.pull_admission import PullTargets
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import copy_blocks
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine

# A 1 GB run in 8 chunks: staging and scattering overlap the wire, and each chunk stays large
# enough for NCCL's full rate (measured on 2 x H100: 4.8 ms as one message, 3.8 ms in 8 chunks;
# bare send/recv 2.7 ms; `benchmarks/gpu_nccl.py`).
PIPELINE_CHUNKS = 8


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

    def warm_up_pairs(self) -> int:
        """One tiny exchange with every other rank, pairs taken in one global order (the lower
        rank sends first), so every communicator exists before the first pull. Returns pairs."""
        import torch.distributed as dist

        probe = torch.zeros(1, device="cuda")
        num_ranks = len(self.ranks)
        pairs = 0
        for low in range(num_ranks):
            for high in range(low + 1, num_ranks):
                if self.rank == low:
                    dist.send(probe, dst=high)
                    dist.recv(probe, src=high)
                elif self.rank == high:
                    dist.recv(probe, src=low)
                    dist.send(probe, dst=low)
                else:
                    continue
                pairs += 1
        torch.cuda.synchronize()
        return pairs

    @staticmethod
    def send(cache: torch.Tensor, ids: list[int], dst_rank: int) -> None:
        """Stage the pinned blocks chunk by chunk with the copy kernel and send each chunk as soon
        as it is staged, so staging the next chunk overlaps sending this one."""
        import torch.distributed as dist  # only multi-GPU deployments need it

        works, stagings = [], []  # each chunk's staging lives until every send is done
        for lo, hi in chunk_spans(len(ids)):
            staging = cache.new_empty((*cache.shape[:2], hi - lo, *cache.shape[3:]))
            copy_blocks(staging, list(range(hi - lo)), cache, ids[lo:hi])
            stagings.append(staging)
            works.append(dist.isend(staging, dst=dst_rank))  # waits for its own staging only
        for work in works:
            assert work is not None  # a process-group op always returns its handle
            work.wait()
        torch.cuda.synchronize()

    @staticmethod
    def recv_into(cache: torch.Tensor, targets: PullTargets, num_blocks: int, src_rank: int) -> int:
        """Receive `num_blocks` (always, so the sender completes) and keep those that line up
        with `targets` (none if the request went away meanwhile). Chunks are scattered into
        their blocks as each arrives, while the later ones are still on the wire."""
        import torch.distributed as dist

        spans = chunk_spans(num_blocks)
        bufs = [cache.new_empty((*cache.shape[:2], hi - lo, *cache.shape[3:])) for lo, hi in spans]
        works = [dist.irecv(buf, src=src_rank) for buf in bufs]
        n = targets.fillable(num_blocks)
        for span, buf, work in zip(spans, bufs, works, strict=True):
            assert work is not None  # a process-group op always returns its handle
            work.wait()  # the stream, not the host, waits for this chunk
            kept = kept_rows(span, targets.first, n)
            if kept is not None:
                to, rows = kept
                copy_blocks(cache, [int(b) for b in targets.blocks[to]], buf, list(rows))
        torch.cuda.synchronize()
        return n


def kept_rows(span: tuple[int, int], first: int, n: int) -> tuple[slice, range] | None:
    """Which received rows of the chunk holding message blocks [lo, hi) are kept, and the slice
    of the targets they go to, when the targets hold message blocks [first, first + n).

        kept_rows((4, 8), first=2, n=4) -> (slice(2, 4), range(0, 2))   # blocks 4, 5
    """
    lo, hi = span
    a, b = max(lo, first), min(hi, first + n)
    if a >= b:
        return None
    return slice(a - first, b - first), range(a - lo, b - lo)


def chunk_spans(num_blocks: int, num_chunks: int = PIPELINE_CHUNKS) -> list[tuple[int, int]]:
    """[lo, hi) block ranges splitting a run into at most `num_chunks` near-equal chunks; both
    sides of a transfer compute the same spans from the same count.

        chunk_spans(10, 4) -> [(0, 2), (2, 5), (5, 8), (8, 10)]
    """
    if num_blocks < 0 or num_chunks < 1:
        raise ValueError(f"{num_blocks} blocks in {num_chunks} chunks")
    k = min(num_chunks, num_blocks)
    bounds = [round(i * num_blocks / k) for i in range(k + 1)] if k else [0]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


class NcclTransport:
    def __init__(
        self,
        peers: PeerLookup,
        runner: ModelRunner,
        link: NcclLink,
        claim_wait_s: float = 0.25,
        retry_s: float = 0.002,
    ) -> None:
        self._peers = peers
        self._runner = runner
        self._link = link
        self.claim_wait_s = claim_wait_s
        self.retry_s = retry_s

    async def _claim_both(self, source: str, hashes: tuple[BlockHash, ...]) -> list[int] | None:
        """Claim this worker and the source (which pins the run and starts sending it); None if
        no moment came when both were free within `claim_wait_s`. On success this worker holds
        its claim, and must receive what the source sends."""
        link, peer = self._link, self._peers(source)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_wait_s
        while True:
            if link.try_claim():
                ids = await peer.nccl_accept(hashes, link.rank)
                if ids is not None:
                    return ids
                link.release()  # the source is busy: let go before waiting
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(self.retry_s)

    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        link = self._link
        if source not in link.ranks:
            return None
        ids = await self._claim_both(source, hashes)
        if ids is None:
            return None
        try:
            if not ids:
                return 0
            src_rank = link.ranks[source]
            cache = self._runner.kv_cache

            def fill(targets: PullTargets) -> int:
                return NcclLink.recv_into(cache, targets, len(ids), src_rank)

            return await write(fill)
        finally:
            link.release()
