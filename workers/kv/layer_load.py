"""A promotion from the pinned host tier that runs layer by layer beside the prefill (CUDA).

The host tier keeps each block as one slab per block (all layers, K and V); the device cache is
layer-major. Layer by layer, on side streams, every promoted block's K and V are written into the
cache and an event is recorded per layer (the runner's layer gate, where it has gates); the forward
pass waits for layer l's event just before layer l's attention. So the PCIe copy of layer l + 1
overlaps the compute of layer l, and a prefill over a promoted prefix costs about max(copy,
compute) instead of their sum.

    host slot s:    [ L0 K V | L1 K V | ... | L31 K V ]      (one block, all layers)
    cache layer l:  K[blocks] V[blocks]  <- layer l of every promoted slot, then event[l]

Two ways to move a layer:
  * copy engine (slots in at most `MAX_COPY_RUNS` runs): one strided DMA per run of consecutive
    slots into a one-layer staging buffer, then one scatter into the cache's blocks, in stream
    order. The DMA engines take no SM from the prefill, but a scatter beside the prefill waits
    for SMs (60-220 us a layer on an H100), and on one stream the next layer's copy waited
    behind it; so even layers go on the load stream and odd ones on a second, each with its own
    staging layer. No waits between the two inside the load (the second waits once at its start
    for what the first holds, the first joins the second once at its end): streams may share a
    hardware queue, where a wait queued ahead of a replayed graph holds the whole graph back
    (seen: a second stream whose scatters waited on the copies' events made a host hit's graph
    start after the last layer had landed).
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

    Invariants: layer l of every target block is written once a stream has waited in
    `wait_layer(l)`; the host slots read are not reused until `done` has completed (their owner
    holds them); nothing reads the target blocks except after waiting for their layer; on the
    copy-engine path, the staging layer is overwritten only after the scatter that read it has
    completed.
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
        second_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`copy_engine` moves the layers when the slots come in at most `MAX_COPY_RUNS` runs;
        otherwise the kernel does; either on `stream`. With `gates`, each landed layer records
        its gate (a captured prefill graph waits on them), which `wait_layer` waits on too.
        `second_stream`: the copy engine's way alternates layers between it and `stream`."""
        if len(slots) != len(blocks) or not slots:
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} cache blocks")
        if not can_load_layers(host_data, cache):
            raise ValueError("layer loads need a CUDA cache and pinned host slots of its layout")
        self.slots = list(slots)
        self.blocks = frozenset(blocks)
        self.overlaps_forward = True  # PCIe: about as long as the prefill beside it
        if gates is not None and gates.num_layers != cache.shape[0]:
            raise ValueError(f"{gates.num_layers} layer gates for {cache.shape[0]} layers")
        self.gated = gates is not None
        self._gates = gates
        # With gates, a layer's gate is its event too: gated writes run in the layer stream's
        # order (a load's second stream waits for it first and is joined back into it last), so
        # a gate's latest record covers this load's layer. One record a layer, not two, on a host
        # hit's path. Without gates, an event of its own for each layer.
        num_layers = cache.shape[0]
        self._events = (
            None if gates is not None else [torch.cuda.Event() for _ in range(num_layers)]
        )
        self._done = torch.cuda.Event()
        self._keep: tuple[torch.Tensor, ...] = ()  # what the side stream reads: alive until
        # `done` (the runner keeps its loads until the step after them has synchronised)
        ordered = slot_runs(self.slots) if copy_engine is not None else None
        self.uses_copy_engine = ordered is not None and len(ordered.runs) <= MAX_COPY_RUNS
        # Each way makes its ids on the main stream, then has `stream` wait for it: for the ids,
        # and because the blocks were just allocated: whatever the main stream still does with
        # them (a demotion copying their old contents out) must finish before they are written.
        if self.uses_copy_engine:
            assert copy_engine is not None and ordered is not None
            rows_to_blocks = [blocks[i] for i in ordered.order]
            self._copy_layers(
                host_data, cache, ordered.runs, rows_to_blocks, copy_engine, stream, second_stream
            )
        else:
            self._load_layers(host_data, cache, blocks, stream)
        self._done.record(stream)

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
        second_stream: torch.cuda.Stream | None,
    ) -> None:
        """The copy engine's way: layer l's runs DMA'd into a staging layer, then scattered into
        the blocks, stream order keeping a staging layer from being overwritten before its
        scatter has read it. With `second_stream`, even layers go on `stream` and odd ones on
        the second, each with its own staging layer, so a layer's copy never waits behind the
        scatter before it (a scatter beside the prefill waits for SMs: 60-220 us a layer)."""
        num_layers, device = cache.shape[0], cache.device
        streams = (stream,) if second_stream is None else (stream, second_stream)
        pair_shape = (2, *cache.shape[3:])  # one block's K and V of one layer
        staging = [
            torch.empty((len(rows_to_blocks), *pair_shape), device=device, dtype=cache.dtype)
            for _ in streams
        ]
        block_ids = torch.tensor(rows_to_blocks, dtype=torch.int64).to(device, non_blocking=True)
        # Kept with the load, not handed to the allocator's cross-stream bookkeeping: a block
        # freed with stream uses queues events, which a graph capture on this thread refuses.
        self._keep = (*staging, block_ids)
        stream.wait_stream(torch.cuda.current_stream(device))  # the ids above
        for other in streams[1:]:  # and every gated write queued on `stream` before this load,
            other.wait_stream(stream)  # so a gate the second stream records covers them too
        # Host time is the cost here (a host hit's forward waits for this loop): pointers by
        # arithmetic, views made once, no stream context a layer.
        slab_elems = staging[0][0, 0].numel()  # one block's K (or V) of one layer
        pair_bytes = 2 * slab_elems * staging[0].element_size()
        host_pitch = host_data[0].numel() * host_data.element_size()  # one slot, all layers
        host_base = host_data.data_ptr()
        bases = [s.data_ptr() for s in staging]
        sources = [s.transpose(0, 1) for s in staging]
        targets = cache.unbind(0)
        caller = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            try:
                for layer in range(num_layers):
                    k = layer % len(streams)
                    on = streams[k]
                    torch.cuda.set_stream(on)
                    for first_row, first_slot, num_slots in runs:
                        copy_engine.host_to_device_2d(
                            bases[k] + first_row * pair_bytes, pair_bytes,
                            host_base + first_slot * host_pitch + layer * pair_bytes, host_pitch,
                            pair_bytes, num_slots, on,
                        )  # fmt: skip
                    targets[layer].index_copy_(1, block_ids, sources[k])
                    self._landed(layer, on)
            finally:
                torch.cuda.set_stream(caller)
        for other in streams[1:]:  # joined: `done`, and any gated write queued on `stream`
            stream.wait_stream(other)  # after this load, come after all of it

    def _landed(self, layer: int, stream: torch.cuda.Stream) -> None:
        if self._gates is not None:
            self._gates.record(layer, stream)
        else:
            assert self._events is not None
            self._events[layer].record(stream)

    @property
    def done(self) -> torch.cuda.Event:
        return self._done

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until `layer` of every target block is written."""
        if self._gates is not None:
            self._gates.wait(layer)
        else:
            assert self._events is not None
            torch.cuda.current_stream().wait_event(self._events[layer])

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)
