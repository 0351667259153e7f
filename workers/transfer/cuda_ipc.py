"""Same-GPU pulls: the source pins its run, the target copies straight out of the source's cache
(mapped once per peer through CUDA IPC) with the block-copy kernel; no staging, no host trip. The
copy runs in layer groups on a side stream (`kv/layer_writes.py`): the request is queued as soon
as it is enqueued, and its forward waits for each group just before that group's first layer.
The source unpins once the GPU has passed the copy. After the first pull from a peer (which maps
its cache), the next ones run inside their request's admission on the engine thread with this
transport's `writer` (`admission_pull.py`)."""

from __future__ import annotations

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.pull_admission import BlockWriter, PullTargets
from kvmesh.workers.kv.layer_writes import LayerGroups, group_spans, until_done
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import BlockPairs, copy_block_pairs
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine

# A copy within one GPU moves a 7.5K-token 8B prefix (~1 GB) in under a millisecond; in four
# groups the forward starts after a quarter of it, with few launches added.
LAYER_GROUPS = 4


class CudaIpcTransport:
    """Invariant: a peer's cache is mapped at most once (`_mapped`) and only read while the
    peer holds pins on the blocks read."""

    def __init__(self, peers: PeerLookup, runner: ModelRunner) -> None:
        self._peers = peers
        self._runner = runner
        self._mapped: dict[str, torch.Tensor] = {}

    def mapped(self, source: str) -> torch.Tensor | None:
        """The peer's cache, if it has been mapped (by a first `fetch`)."""
        return self._mapped.get(source)

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
        ids = await peer.pin(hashes)
        copied: list[torch.cuda.Event] = []
        try:
            return await write(self.writer(self._mapped[source], ids, copied))
        finally:
            if ids:
                await self.unpin_after(source, ids, copied)

    def writer(
        self, peer_cache: torch.Tensor, ids: list[int], copied: list[torch.cuda.Event]
    ) -> BlockWriter:
        """Copies the pinned run `ids` of `peer_cache` into the reserved blocks it is given, in
        layer groups on the runner's layer stream; appends the copy's last event to `copied`."""

        def fill(targets: PullTargets) -> int:
            n = targets.fillable(len(ids))
            if n:
                ours = self._runner.kv_cache
                check_same_layout(ours, peer_cache)
                dst = [int(b) for b in targets.blocks[:n]]
                pairs = BlockPairs(ids[targets.first : targets.first + n], dst)
                if not ours.is_cuda:  # a cache on the CPU (tests): copied now, nothing to wait for
                    copy_block_pairs(ours, peer_cache, pairs)
                    return n
                groups = LayerGroups(
                    group_spans(ours.shape[0], LAYER_GROUPS),
                    self._runner.block_io.layer_stream(),
                    dst,
                    lambda lo, hi: copy_block_pairs(ours[lo:hi], peer_cache[lo:hi], pairs),
                    self._runner.block_io.layer_gates,
                )
                # The request's forward waits per group; only the peer's unpin waits for all
                # of it, and not the request.
                self._runner.block_io.add_layer_writes(groups)
                copied.append(groups.done)
            return n

        return fill

    async def unpin_after(
        self, source: str, ids: list[int], copied: list[torch.cuda.Event]
    ) -> None:
        """Let the peer unpin `ids` once the GPU has passed every copy out of them."""
        for done in copied:
            await until_done(done)
        await self._peers(source).unpin(ids)


def check_same_layout(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Caches may differ in block count only."""
    if theirs.shape[:2] != ours.shape[:2] or theirs.shape[3:] != ours.shape[3:]:
        raise ValueError(
            f"peer cache {tuple(theirs.shape)} does not match ours {tuple(ours.shape)}"
        )
    if theirs.dtype != ours.dtype:
        raise ValueError(f"peer cache is {theirs.dtype}, ours {ours.dtype}")
