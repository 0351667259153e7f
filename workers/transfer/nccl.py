"""GPU-to-GPU pulls over NCCL (one rank per GPU): the source pins its run and sends it, the
target receives it and writes it into the reserved blocks. One call to the source does both:
`nccl_accept` pins the run, answers with its block ids and starts the send at once, which
completes when the target posts its receive.

The run travels in layer groups (layers [lo, hi) of every block in one message), so the target's
forward waits for a group only just before its first layer (`kv/layer_writes.py`): the wire and
the scatter into the blocks overlap the prefill that reads them, and neither side's host waits for
the transfer (the source unpins, and both let go of their claims, once the GPU has passed it).

    source:  stage group g (copy kernel) -> isend g          (side stream, host returns)
    target:  irecv every group; for g: wait g -> scatter g into the blocks -> event g
    forward: layer l waits for the event of l's group

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
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.pull_admission import PullTargets
from kvmesh.workers.kv.layer_gates import LayerGates
from kvmesh.workers.kv.layer_writes import LayerGroups, group_spans, until_done
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import BlockPairs, copy_block_pairs
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine

# A 1 GB run in 8 messages: staging and scattering overlap the wire, and each message stays
# large enough for NCCL's full rate (measured on 2 x H100: 4.8 ms as one message, 3.8 ms in 8;
# bare send/recv 2.7 ms; `benchmarks/gpu_nccl.py`). A message is a group of layers.
PIPELINE_CHUNKS = 8

log = logging.getLogger(__name__)


@dataclass
class NcclSending:
    """A send under way: `done` completes once the target has received every group; `staging`
    must outlive it (the wire reads it)."""

    done: torch.cuda.Event
    staging: list[torch.Tensor]


class NcclLink:
    """This worker's place in the NCCL group. Invariant: `busy` while a send or receive of this
    worker is agreed and not yet done; claimed and released on the actor's event loop only."""

    def __init__(self, rank: int, ranks: dict[str, int]) -> None:
        self.rank = rank
        self.ranks = dict(ranks)
        self.busy = False
        self._send_stream: torch.cuda.Stream | None = None

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

    def send(self, cache: torch.Tensor, ids: list[int], dst_rank: int) -> NcclSending:
        """Stage the pinned blocks layer group by layer group with the copy kernel and send each
        group as soon as it is staged, all on this link's side stream: the host returns at once,
        and the engine's own stream never waits for the target."""
        import torch.distributed as dist  # only multi-GPU deployments need it

        if self._send_stream is None:
            self._send_stream = torch.cuda.Stream(cache.device)
        stream = self._send_stream
        stream.wait_stream(torch.cuda.current_stream(cache.device))
        works, staging = [], []
        pairs = BlockPairs(ids, list(range(len(ids))))
        with torch.cuda.stream(stream):
            for lo, hi in group_spans(cache.shape[0], PIPELINE_CHUNKS):
                buf = cache.new_empty((hi - lo, 2, len(ids), *cache.shape[3:]))
                copy_block_pairs(buf, cache[lo:hi], pairs)
                staging.append(buf)
                works.append(dist.isend(buf, dst=dst_rank))  # waits for its own staging only
            for work in works:
                assert work is not None  # a process-group op always returns its handle
                work.wait()  # the side stream, not the host, waits
            done = torch.cuda.Event()
            done.record(stream)
        return NcclSending(done, staging)

    @staticmethod
    def receive(
        cache: torch.Tensor,
        targets: PullTargets,
        num_blocks: int,
        src_rank: int,
        stream: torch.cuda.Stream,
        gates: LayerGates | None = None,
    ) -> LayerGroups:
        """Receive `num_blocks` (always, so the sender completes) and write those that line up
        with `targets` (none if the request went away meanwhile), group by group on `stream`:
        every receive is posted at once, and each group is scattered into its blocks as it
        arrives, while the later ones are still on the wire."""
        import torch.distributed as dist

        spans = group_spans(cache.shape[0], PIPELINE_CHUNKS)
        n = targets.fillable(num_blocks)
        dst = [int(b) for b in targets.blocks[:n]]
        pairs = BlockPairs(list(range(targets.first, targets.first + n)), dst)
        with torch.cuda.stream(stream):  # posted behind the side stream, not the engine's
            bufs = [cache.new_empty((hi - lo, 2, num_blocks, *cache.shape[3:])) for lo, hi in spans]
            works = [dist.irecv(buf, src=src_rank) for buf in bufs]
        arrivals = iter(zip(bufs, works, strict=True))

        def scatter(lo: int, hi: int) -> torch.Tensor:
            buf, work = next(arrivals)
            assert work is not None  # a process-group op always returns its handle
            work.wait()  # the side stream waits for this group; later ones still arrive
            if n:
                copy_block_pairs(cache[lo:hi], buf, pairs)
            return buf

        return LayerGroups(spans, stream, dst, scatter, gates)


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
            runner = self._runner
            received: list[LayerGroups] = []

            def fill(targets: PullTargets) -> int:
                groups = NcclLink.receive(
                    runner.kv_cache,
                    targets,
                    len(ids),
                    src_rank,
                    runner.block_io.layer_stream(),
                    runner.block_io.layer_gates,
                )
                received.append(groups)
                n = targets.fillable(len(ids))
                if n:
                    runner.block_io.add_layer_writes(
                        groups
                    )  # the request's forward waits per layer
                else:
                    groups.done.synchronize()  # nothing waits for it: drain the wire now
                return n

            return await write(fill)
        finally:
            for groups in received:
                await until_done(groups.done)  # one transfer at a time, on the GPU too
            link.release()


async def serve_send(
    link: NcclLink,
    cache: torch.Tensor,
    ids: list[int],
    dst_rank: int,
    on_engine: Callable[[Callable[[], Any]], Awaitable[Any]],
    unpin: Callable[[], None],
) -> None:
    """The source's half of a pull, once `nccl_accept` has pinned `ids` and claimed `link`: the
    send starts on the engine thread (where every NCCL call of this worker is made, so the two
    sides' calls pair up in order), the event loop waits for the GPU to pass it, then the run
    is unpinned on the engine thread and the claim let go. A failed send is logged; the puller
    recomputes what did not arrive."""
    try:
        sending: NcclSending = await on_engine(lambda: link.send(cache, ids, dst_rank))
        await until_done(sending.done)
    except Exception:
        log.exception("nccl send of %d blocks to rank %d failed", len(ids), dst_rank)
    finally:
        try:
            await on_engine(unpin)
        finally:
            link.release()
