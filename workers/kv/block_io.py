"""Whole blocks in and out of the model runner's paged KV cache: copied out for a peer or the host
tier (`export_blocks`), written in at once (`import_blocks`) or layer by layer beside the forward
that reads them (`load_layers`, and the writes of pulls: `layer_writes.py`).

The runner's forward asks this module what it must wait for: the layered writes still pending
(`pending`), each a layer at a time before that layer's attention, and the gates a captured
prefill graph waits on instead (`layer_gates`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.kv.copy_engine import CopyEngine
from kvmesh.workers.kv.layer_gates import LayerGates
from kvmesh.workers.kv.layer_load import LayerLoad, can_load_layers
from kvmesh.workers.kv.layer_writes import LayerWrites
from kvmesh.workers.transfer.block_copy import copy_block_runs, copy_blocks

__all__ = ["BlockIO"]

_FEW_PIECES = 4
"""A copy within the cache of at most this many runs (source and destination both consecutive)
goes as that many slice copies; more, as one kernel over the pairs."""


class BlockIO:
    """The block traffic of one cache tensor, [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim] (keys, then values, of each layer).

    Invariants:
      * every write added (`add_layer_writes`, `load_layers`) stays in `pending` until
        `take_layer_writes`; a copy out of a block waits on the stream for the pending writes
        into it, and `settle_layer_writes` on the host
      * block ids are checked against the pool before any copy: a bad id copies nothing
    """

    def __init__(self, cache: torch.Tensor, *, gates: LayerGates | None, layered: bool) -> None:
        """`gates`: the prefill graphs' layer gates that layer loads record (None without
        them); `layered`: host-tier promotions may run as layer loads (CUDA)."""
        self.cache = cache
        self.num_blocks = cache.shape[2]
        self.layer_gates = gates
        """The gates layered writes record and prefill graphs wait on (None without prefill
        graphs, or where torch makes no external events)."""
        self.layered_loads = layered
        """Host-tier promotions run layer by layer beside the prefill (`load_layers`) instead of
        as one copy before it; benchmarks and tests may switch it."""
        self.copy_engine = CopyEngine.find() if layered else None
        """Moves layer loads whose host slots come in runs (`LayerLoad`); None: the kernel
        moves them all (no runtime library to bind, or switched off by a benchmark)."""
        self.num_layer_loads = 0
        """Promotions started as layer loads, since construction."""
        self.num_copy_engine_loads = 0
        """Of those, the ones the copy engine moved."""
        self.pending: list[LayerWrites] = []
        """Layered writes the next forwards wait for, layer by layer, oldest first."""
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def check_invariants(self) -> None:
        assert self.cache.dim() == 6 and self.cache.shape[1] == 2, tuple(self.cache.shape)
        assert self.num_blocks == self.cache.shape[2], (self.num_blocks, tuple(self.cache.shape))
        assert 0 <= self.num_copy_engine_loads <= self.num_layer_loads

    @property
    def block_num_bytes(self) -> int:
        """Bytes one block holds: its keys and values in every layer."""
        return self.cache[:, :, :1].numel() * self.cache.element_size()

    # ---- copies out and in --------------------------------------------------------------------

    @torch.inference_mode()
    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy whole blocks, all layers, K and V, into one contiguous tensor (on the cache device):
        [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim], block-major so each
        block is one contiguous slab."""
        ids = self._block_id_tensor(block_ids, unique=False)
        self._wait_for_writes_into(block_ids)
        return self.cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous()

    @torch.inference_mode()
    def copy_within(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """dst block i := src block i, all layers, on the current stream (a slice copy per run
        of pairs, or one kernel over many pairs on CUDA): a prompt's cached tail moved into a
        run (`Sequence.relocated`). A pending layered write into a source is waited for on the
        stream first, as `export_blocks` does."""
        src = self._check_block_ids(src_ids, unique=True)
        dst = self._check_block_ids(dst_ids, unique=True)
        if set(src) & set(dst):
            raise ValueError("a block copied within the cache is both read and written")
        self._wait_for_writes_into(src)
        pieces = 1 + sum(
            s != src[i - 1] + 1 or d != dst[i - 1] + 1
            for i, (s, d) in enumerate(zip(src, dst, strict=True))
            if i
        )
        if pieces <= _FEW_PIECES:  # a slice copy each: no ids to the device, no kernel launch
            copy_block_runs(self.cache, dst, self.cache, src)
        else:
            copy_blocks(self.cache, dst, self.cache, src)

    def writing(self, block_ids: Sequence[int]) -> bool:
        """Whether a pending layered write lands in any of these blocks."""
        return any(not writes.blocks.isdisjoint(block_ids) for writes in self.pending)

    def _wait_for_writes_into(self, block_ids: Sequence[int]) -> None:
        """Make the current stream wait for every pending layered write into these blocks (they
        are still landing: a copy out of them must come after)."""
        if self.pending:
            wanted = {int(b) for b in block_ids}
            for writes in self.pending:
                if not writes.blocks.isdisjoint(wanted):
                    writes.wait_all()

    @torch.inference_mode()
    def import_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Overwrite blocks with the layout `export_blocks` produces (from any device)."""
        ids = self._block_id_tensor(block_ids, unique=True)
        expected = (len(ids), *self.cache.shape[:2], *self.cache.shape[3:])
        if tuple(blocks.shape) != expected:
            raise ValueError(f"blocks have shape {tuple(blocks.shape)}, expected {expected}")
        if blocks.dtype != self.cache.dtype:
            raise ValueError(f"blocks are {blocks.dtype}, the cache is {self.cache.dtype}")
        self.cache[:, :, ids] = blocks.to(self.cache.device).permute(1, 2, 0, 3, 4, 5)

    def can_load_layers(self, host_data: torch.Tensor) -> bool:
        """Whether `load_layers` can read these host slots (CUDA, pinned, the cache's layout)."""
        return self.layered_loads and can_load_layers(host_data, self.cache)

    @torch.inference_mode()
    def load_layers(
        self,
        host_data: torch.Tensor,
        slots: Sequence[int],
        block_ids: Sequence[int],
        *,
        kernel_only: bool = False,
    ) -> LayerLoad:
        """Start copying host slots (block-major, `export_blocks` layout) into `block_ids`, layer
        by layer on a side stream; the next forwards wait per layer (see `LayerLoad`: the copy
        engine where the slots come in runs, unless `kernel_only`, else the kernel). The caller
        ends it with `take_layer_writes` once a step is over."""
        ids = self._check_block_ids(block_ids, unique=True)
        load = LayerLoad(
            host_data, slots, self.cache, ids, self.layer_stream(),
            copy_engine=None if kernel_only else self.copy_engine, gates=self.layer_gates,
            second_stream=self.layer_stream(second=True),
        )  # fmt: skip
        self.add_layer_writes(load)
        self.num_layer_loads += 1
        self.num_copy_engine_loads += load.uses_copy_engine
        return load

    def layer_stream(self, *, second: bool = False) -> torch.cuda.Stream:
        """The side stream layered writes run on (CUDA only); `second`: the one a host-tier
        load alternates layers with (`LayerLoad`)."""
        if self._streams is None:
            # High priority: its copy programs take SMs as the prefill's kernels free them, so
            # layer l + 1 arrives while layer l computes instead of after the whole forward.
            device = self.cache.device
            self._streams = (
                torch.cuda.Stream(device, priority=-1),
                torch.cuda.Stream(device, priority=-1),
            )
        return self._streams[int(second)]

    # ---- pending layered writes ---------------------------------------------------------------

    def add_layer_writes(self, writes: LayerWrites) -> None:
        """Make the next forwards wait for `writes` layer by layer (see `kv/layer_writes.py`)."""
        self.pending.append(writes)

    def take_layer_writes(self) -> list[LayerWrites]:
        """The pending layered writes, no longer waited for by later forwards."""
        writes, self.pending = self.pending, []
        return writes

    def settle_layer_writes(self, block_ids: Sequence[int]) -> None:
        """Wait on the host until every pending layered write into `block_ids` has landed: they
        are registered already, and a peer that copies them (in its own process, on its own
        stream) must not read them half written."""
        wanted = {int(b) for b in block_ids}
        for writes in self.pending:
            if not writes.blocks.isdisjoint(wanted):
                writes.done.synchronize()

    # ---- block ids ----------------------------------------------------------------------------

    def _check_block_ids(self, block_ids: Sequence[int], *, unique: bool) -> list[int]:
        """The ids as ints, checked in Python (a promotion's few hundred: no tensor round trip
        on the request's path)."""
        ids = [int(b) for b in block_ids]
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ValueError(
                f"block ids span [{min(ids)}, {max(ids)}], pool has [0, {self.num_blocks})"
            )
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"{len(ids)} block ids contain duplicates")
        return ids

    def _block_id_tensor(self, block_ids: Sequence[int], *, unique: bool) -> torch.Tensor:
        ids = self._check_block_ids(block_ids, unique=unique)
        return torch.tensor(ids, dtype=torch.int64).to(self.cache.device)
