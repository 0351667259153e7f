"""A promotion from the pinned host tier that runs layer by layer beside the prefill (CUDA).

The host tier keeps each block as one slab per block (all layers, K and V); the device cache is
layer-major. Layer by layer, on a side stream, every promoted block's K and V are written into the
cache and an event is recorded per layer; the forward pass waits for layer l's event just before
layer l's attention. So the PCIe copy of layer l + 1 overlaps the compute of layer l, and a
prefill over a promoted prefix costs about max(copy, compute) instead of their sum.

    host slot s:    [ L0 K V | L1 K V | ... | L31 K V ]      (one block, all layers)
    cache layer l:  K[blocks] V[blocks]  <- layer l of every promoted slot, then event[l]

Two ways to move a layer:
  * copy engine (slots in at most `MAX_COPY_RUNS` runs): one strided DMA per run of consecutive
    slots into a one-layer staging buffer, then one scatter into the cache's blocks, in stream
    order. The DMA engines take no SM from the prefill. One stream and no waits on it: streams
    may share a hardware queue, where a wait queued ahead of a replayed graph would hold the
    whole graph back (seen: a second stream whose scatters waited on the copies made a host
    hit's graph start after the last layer had landed). On one stream a layer's copy starts
    after the previous scatter anyway, so a deeper staging ring bought nothing (measured with
    four layers).
  * kernel (any slots): a Triton kernel of a few persistent programs reads the pinned slots in
    place (pinned memory is addressable from the GPU). Measured on an H100: 480 scattered 64 KB
    host rows at 47.8 GB/s, 93% of a contiguous pinned copy (`benchmarks/gpu_zero_copy_probe.py`),
    but its programs hold SMs the prefill's matmuls want.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.kv.copy_engine import CopyEngine
from kvmesh.workers.kv.layer_gates import LayerGates
from kvmesh.workers.kv.slot_runs import slot_runs

try:  # Triton ships with CUDA builds of torch; CPU builds do without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


_CHUNK = 4096  # elements one step of a program moves (8 KB of bf16)
_NUM_PROGRAMS = 32  # a few SMs: enough loads in flight for PCIe, the rest left to the prefill
MAX_COPY_RUNS = 32
"""Most runs a layer the copy engine takes (one host call per run and layer). A host tier's free
slots fragment as it evicts, so after a while a promoted chain comes in 8-14 runs: at 9-14 runs
the copy engine still loads beside the prefill in about the time of 4-6 (host hit 24.4 ms against
33.4 by the kernel, 64-token blocks, one H100), its calls enqueued while the first layers move.
Past 32 (1,024 calls for the 8B shape's 32 layers) the kernel takes the slots as they come."""

if triton is not None:
    # One compiled variant serves every load: Triton would otherwise specialise these on their
    # value (1, divisible by 16), so layers 1 and 16 and each new kind of block count would
    # compile on a request's path (a few hundred ms each) on the first host hits.
    @triton.jit(
        do_not_specialize=["layer", "num_layers", "num_cache_blocks", "num_pairs", "slab_elems"]
    )
    def _load_layer_kernel(
        host_ptr,
        cache_ptr,
        slots_ptr,
        blocks_ptr,
        layer,
        num_layers,
        num_cache_blocks,
        num_pairs,
        slab_elems,
        CHUNK: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
    ):
        # A few persistent programs walk the (block pair, K or V, chunk) items between them, so
        # the copy holds a handful of SMs while the prefill's kernels keep the others.
        chunks_per_slab = tl.cdiv(slab_elems, CHUNK)
        num_items = num_pairs * 2 * chunks_per_slab
        for item in range(tl.program_id(0), num_items, NUM_PROGRAMS):
            pair = item // (2 * chunks_per_slab)
            kv = ((item // chunks_per_slab) % 2).to(tl.int64)
            offs = (item % chunks_per_slab) * CHUNK + tl.arange(0, CHUNK)
            mask = offs < slab_elems
            slot = tl.load(slots_ptr + pair).to(tl.int64)
            block = tl.load(blocks_ptr + pair).to(tl.int64)
            src_base = ((slot * num_layers + layer) * 2 + kv) * slab_elems
            dst_base = ((layer * 2 + kv) * num_cache_blocks + block) * slab_elems
            values = tl.load(host_ptr + src_base + offs, mask=mask)
            tl.store(cache_ptr + dst_base + offs, values, mask=mask)


def can_load_layers(host_data: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `LayerLoad` can run here: CUDA cache, Triton, pinned host slots of the cache's
    dtype and block layout."""
    return (
        triton is not None
        and cache.is_cuda
        and host_data.is_pinned()
        and host_data.dtype == cache.dtype
        and host_data.is_contiguous()
        and cache.is_contiguous()
        and tuple(host_data.shape[1:]) == (*cache.shape[:2], *cache.shape[3:])
    )


class LayerLoad:
    """Host slots -> cache blocks, one layer at a time on `stream`, started at construction.

    Invariants: layer l of every target block is written once `events[l]` has completed; the
    host slots read are not reused until `done` has completed (their owner holds them); nothing
    reads the target blocks except after waiting for their layer's event; on the copy-engine
    path, the staging layer is overwritten only after the scatter that read it has completed.
    """

    def __init__(
        self,
        host_data: torch.Tensor,
        slots: Sequence[int],
        cache: torch.Tensor,
        blocks: Sequence[int],
        stream: torch.cuda.Stream,
        *,
        copy_engine: CopyEngine | None = None,
        gates: LayerGates | None = None,
    ) -> None:
        """`copy_engine` moves the layers when the slots come in at most `MAX_COPY_RUNS` runs;
        otherwise the kernel does; either on `stream`. `gates` are recorded beside the load's
        own events (a captured prefill graph waits on them)."""
        if len(slots) != len(blocks) or not slots:
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} cache blocks")
        if not can_load_layers(host_data, cache):
            raise ValueError("layer loads need a CUDA cache and pinned host slots of its layout")
        self.slots = list(slots)
        self.blocks = frozenset(int(b) for b in blocks)
        self.overlaps_forward = True  # PCIe: about as long as the prefill beside it
        if gates is not None and gates.num_layers != cache.shape[0]:
            raise ValueError(f"{gates.num_layers} layer gates for {cache.shape[0]} layers")
        self.gated = gates is not None
        self._gates = gates
        self.events = [torch.cuda.Event() for _ in range(cache.shape[0])]
        self._keep: tuple[torch.Tensor, ...] = ()  # what the side stream reads: alive until
        # `done` (the runner keeps its loads until the step after them has synchronised)
        ordered = slot_runs(self.slots) if copy_engine is not None else None
        self.uses_copy_engine = ordered is not None and len(ordered.runs) <= MAX_COPY_RUNS
        # Each way makes its ids on the main stream, then has `stream` wait for it: for the ids,
        # and because the blocks were just allocated: whatever the main stream still does with
        # them (a demotion copying their old contents out) must finish before they are written.
        if self.uses_copy_engine:
            assert copy_engine is not None and ordered is not None
            rows_to_blocks = [int(blocks[i]) for i in ordered.order]
            self._copy_layers(host_data, cache, ordered.runs, rows_to_blocks, copy_engine, stream)
        else:
            self._load_layers(host_data, cache, blocks, stream)

    def _load_layers(
        self,
        host_data: torch.Tensor,
        cache: torch.Tensor,
        blocks: Sequence[int],
        stream: torch.cuda.Stream,
    ) -> None:
        """The kernel's way: every layer read from the slots in place, on `stream`."""
        num_layers, num_cache_blocks = cache.shape[0], cache.shape[2]
        slot_ids = torch.tensor(self.slots, dtype=torch.int32).to(cache.device, non_blocking=True)
        block_ids = torch.tensor(list(blocks), dtype=torch.int32).to(
            cache.device, non_blocking=True
        )
        self._keep = (slot_ids, block_ids)
        stream.wait_stream(torch.cuda.current_stream(cache.device))  # the ids above
        slab_elems = cache[0, 0, 0].numel()
        with torch.cuda.stream(stream):
            for layer in range(num_layers):
                _load_layer_kernel[(_NUM_PROGRAMS,)](
                    host_data, cache, slot_ids, block_ids, layer, num_layers,
                    num_cache_blocks, len(self.slots), slab_elems, CHUNK=_CHUNK,
                    NUM_PROGRAMS=_NUM_PROGRAMS, num_warps=8,
                )  # fmt: skip
                self._landed(layer, stream)

    def _copy_layers(
        self,
        host_data: torch.Tensor,
        cache: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        rows_to_blocks: list[int],
        copy_engine: CopyEngine,
        stream: torch.cuda.Stream,
    ) -> None:
        """The copy engine's way, all on `stream`: layer l's runs DMA'd into the staging layer,
        then scattered into the blocks (stream order keeps the staging layer from being
        overwritten before its scatter has read it)."""
        num_layers, device = cache.shape[0], cache.device
        pair_shape = (2, *cache.shape[3:])  # one block's K and V of one layer
        staging = torch.empty((len(rows_to_blocks), *pair_shape), device=device,
                              dtype=cache.dtype)  # fmt: skip
        block_ids = torch.tensor(rows_to_blocks, dtype=torch.int64).to(device, non_blocking=True)
        # Kept with the load, not handed to the allocator's cross-stream bookkeeping: a block
        # freed with stream uses queues events, which a graph capture on this thread refuses.
        self._keep = (staging, block_ids)
        stream.wait_stream(torch.cuda.current_stream(device))  # the ids above
        # Host time is the cost here (a host hit's forward waits for this loop): pointers by
        # arithmetic, views made once, one stream context.
        pair_bytes = staging[0].numel() * staging.element_size()
        host_pitch = host_data[0].numel() * host_data.element_size()  # one slot, all layers
        host_base, staging_base = host_data.data_ptr(), staging.data_ptr()
        source = staging.transpose(0, 1)
        targets = cache.unbind(0)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for layer in range(num_layers):
                for first_row, first_slot, num_slots in runs:
                    copy_engine.host_to_device_2d(
                        staging_base + first_row * pair_bytes, pair_bytes,
                        host_base + first_slot * host_pitch + layer * pair_bytes, host_pitch,
                        pair_bytes, num_slots, stream,
                    )  # fmt: skip
                targets[layer].index_copy_(1, block_ids, source)
                self._landed(layer, stream)

    def _landed(self, layer: int, stream: torch.cuda.Stream) -> None:
        self.events[layer].record(stream)
        if self._gates is not None:
            self._gates.record(layer, stream)

    @property
    def done(self) -> torch.cuda.Event:
        return self.events[-1]

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until `layer` of every target block is written."""
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)
