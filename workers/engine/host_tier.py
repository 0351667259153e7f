"""The pinned host-memory tier as the engine uses it: blocks the device pool evicts are copied
out before they are overwritten (demotion), and host-tier continuations of waiting prompts are
copied back and pinned for their request (promotion), the way a pull is.

    device pool:  [ held ............ ][ evicted ]--demote-->  host pool
    waiting seq:  [ held on device ][ on host ]  --promote--> reserved, written, pinned for it

While the engine is idle, `write_back` copies the blocks the device pool will evict next to the
host ahead of time, so evicting them later (when a request needs the room) copies nothing. On a
GPU a promotion runs layer by layer beside the step's prefill (`kv/layer_load.py`) and has
landed by the end of that step (`end_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.sequence import Sequence
from kvmesh.workers.kv import pull_reservation
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.model.runner import ModelRunner

WRITE_BACK_TICK_BYTES = 32 << 20
"""The most one idle write-back tick copies. The engine holds the worker's state through the
tick, so a request arriving meanwhile waits for it: ~0.8 ms at the 44 GB/s a demotion moves on
an H100 host (`benchmarks/gpu_transfer.py`), where 64 blocks a tick (before) were 3.0 ms of
Llama-3-8B's 2 MiB blocks and 12 ms of its 64-token (8 MiB) blocks."""


class HostTier:
    """Invariant: every registered block the device pool reallocates is offered to the host pool
    (`demote_evicted` runs before anything overwrites reallocated blocks)."""

    def __init__(
        self, host_pool: HostPool | None, pool: BlockPool, runner: ModelRunner, block_size: int
    ) -> None:
        self.host_pool = host_pool
        self.pool = pool
        self.runner = runner
        self.block_size = block_size

    def demote_evicted(self) -> None:
        evicted = self.pool.drain_evicted()
        if self.host_pool is None or not evicted:
            return
        self._put(evicted, announce=True)

    def _put(self, blocks: list[tuple[BlockId, BlockHash]], *, announce: bool) -> int:
        """Copy to the host the given device blocks it lacks; returns how many were copied.
        `announce`: the device has let them go (eviction), so the index may learn of them."""
        assert self.host_pool is not None
        hashes = [h for _b, h in blocks]
        missing = self.host_pool.missing(hashes)
        if missing:
            ids = [blocks[i][0] for i in missing]
            copies = self.runner.block_io.export_blocks(ids)
            self.host_pool.put([hashes[i] for i in missing], copies, announce=False)
        if announce:
            self.host_pool.announce(hashes)
        return len(missing)

    def write_back(self, look_ahead: int, max_bytes: int = WRITE_BACK_TICK_BYTES) -> int:
        """Copy up to `max_bytes` (at least a block) of the device pool's next `look_ahead`
        evictions that the host tier lacks (the blocks a request would take first); returns how
        many blocks were copied."""
        if self.host_pool is None or look_ahead <= 0:
            return 0
        max_blocks = max(1, max_bytes // self.runner.block_io.block_num_bytes)
        # At most half the host tier: copies made ahead must not push each other out (an idle
        # worker would copy forever) nor crowd out the blocks the device has already let go.
        candidates = self.pool.next_evicted(min(look_ahead, self.host_pool.num_slots // 2))
        missing = self.host_pool.missing([h for _b, h in candidates])[:max_blocks]
        if not missing:
            return 0
        copied = self._put([candidates[i] for i in missing], announce=False)
        cache = self.runner.kv_cache
        if cache.is_cuda:  # one batch in flight at a time: a request arriving now waits for
            torch.cuda.current_stream(cache.device).synchronize()  # this batch, not a backlog
        return copied

    def promote(self, waiting: Iterable[Sequence], unpin: Callable[[Sequence], None]) -> int:
        """Promote and pin what the host tier holds past each waiting prompt's device prefix;
        returns the tokens promoted."""
        if self.host_pool is None or not self.host_pool.num_cached:
            return 0
        return sum(self._promote_one(seq, unpin) for seq in waiting)

    def _promote_one(self, seq: Sequence, unpin: Callable[[Sequence], None]) -> int:
        assert self.host_pool is not None
        if seq.bypass_cache:
            return 0
        bs = self.block_size
        chain = seq.reusable_block_hashes(bs)
        k = len(seq.reusable_prefix_in(self.pool, bs))
        n = self.host_pool.match(chain[k:])
        if not n:
            return 0
        reservation = pull_reservation.reserve(self.pool, chain, k + n, seq.root_hash, 0)
        self.demote_evicted()
        if reservation is None:
            return 0
        run = list(reservation.hashes)
        targets = [int(b) for b in reservation.targets]
        try:
            if self.runner.block_io.can_load_layers(self.host_pool.data):
                slots = self.host_pool.slots_for(run)
                self.host_pool.hold(slots)  # read by the load until this step ends
                self.runner.block_io.load_layers(self.host_pool.data, slots, targets)
            else:
                data = self.host_pool.get(run, self.runner.kv_cache.device)
                self.runner.block_io.import_blocks(targets, data)
            written = len(run)
        except (KeyError, ValueError):
            written = 0  # a slot the host tier gave up meanwhile: recompute instead
        pinned, promoted = pull_reservation.commit(self.pool, reservation, written, chain)
        unpin(seq)
        seq.pinned_blocks = pinned
        if seq.num_cached_tokens is None:
            seq.num_host_tokens += promoted * bs
        return promoted * bs

    def warm_up(self) -> None:
        """Compile the layer-load kernel now (a few hundred ms), not on the first host hit, and
        make the copy engine's first load (its staging, its stream): one slot into block 0,
        which a pool that has served nothing holds no KV in, each way."""
        pool, host_pool = self.pool, self.host_pool
        if host_pool is None or not self.runner.block_io.can_load_layers(host_pool.data):
            return
        if pool.num_cached or pool.ref_count(BlockId(0)):
            raise ValueError("warm_up overwrites block 0: call it before the pool serves")
        self.runner.block_io.load_layers(host_pool.data, [0], [0], kernel_only=True)
        self.end_step()
        if self.runner.block_io.copy_engine is not None:
            self.runner.block_io.load_layers(host_pool.data, [0], [0])
            self.end_step()

    def end_step(self) -> None:
        """A step is over: every layered write it waited for (a promotion, a pull) has landed
        (usually long since: the step's forward waited for each layer, and sampling waited for
        the forward), so nothing outlives the step that follows it, and the host slots they read
        are free again."""
        for writes in self.runner.block_io.take_layer_writes():
            writes.done.synchronize()
        if self.host_pool is not None:
            self.host_pool.release_held()

    def export_after(self, hashes: Seq[BlockHash]) -> tuple[torch.Tensor | None, list[BlockHash]]:
        """The host tier's leading run of `hashes` (a peer pulls it after the device run)."""
        if self.host_pool is None:
            return None, []
        n = self.host_pool.match(hashes)
        if not n:
            return None, []
        run = list(hashes[:n])
        return self.host_pool.get(run, self.runner.kv_cache.device), run
