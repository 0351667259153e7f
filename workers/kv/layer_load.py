"""A promotion from the pinned host tier that runs layer by layer beside the prefill (CUDA).

The host tier keeps each block as one slab per block (all layers, K and V); the device cache is
layer-major. A Triton kernel reads the host slots in place (pinned memory is addressable from the
GPU) and writes one layer of every promoted block into the cache, on a side stream, recording an
event per layer; the forward pass waits for layer l's event just before layer l's attention. So
the PCIe copy of layer l + 1 overlaps the compute of layer l, and a prefill over a promoted
prefix costs about max(copy, compute) instead of their sum.

    host slot s:    [ L0 K V | L1 K V | ... | L31 K V ]      (one block, all layers)
    cache layer l:  K[blocks] V[blocks]  <- layer l of every promoted slot, then event[l]

Measured on an H100: the kernel gathers 480 scattered 64 KB host rows at 47.8 GB/s, 93% of a
contiguous pinned copy (`benchmarks/gpu_zero_copy_probe.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds do without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


_CHUNK = 4096  # elements one step of a program moves (8 KB of bf16)
_NUM_PROGRAMS = 32  # a few SMs: enough loads in flight for PCIe, the rest left to the prefill

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
    reads the target blocks except after waiting for their layer's event.
    """

    def __init__(
        self,
        host_data: torch.Tensor,
        slots: Sequence[int],
        cache: torch.Tensor,
        blocks: Sequence[int],
        stream: torch.cuda.Stream,
    ) -> None:
        if len(slots) != len(blocks) or not slots:
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} cache blocks")
        if not can_load_layers(host_data, cache):
            raise ValueError("layer loads need a CUDA cache and pinned host slots of its layout")
        num_layers, num_cache_blocks = cache.shape[0], cache.shape[2]
        device = cache.device
        self.slots = list(slots)
        self.blocks = frozenset(int(b) for b in blocks)
        self.overlaps_forward = True  # PCIe: about as long as the prefill beside it
        self._slot_ids = torch.tensor(self.slots, dtype=torch.int32).to(device, non_blocking=True)
        self._block_ids = torch.tensor(list(blocks), dtype=torch.int32).to(
            device, non_blocking=True
        )
        self.events = [torch.cuda.Event() for _ in range(num_layers)]
        slab_elems = cache[0, 0, 0].numel()
        # The blocks were just allocated: whatever the main stream still does with them (a
        # demotion copying their old contents out) must finish before they are overwritten.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for layer in range(num_layers):
                _load_layer_kernel[(_NUM_PROGRAMS,)](
                    host_data, cache, self._slot_ids, self._block_ids, layer, num_layers,
                    num_cache_blocks, len(self.slots), slab_elems, CHUNK=_CHUNK,
                    NUM_PROGRAMS=_NUM_PROGRAMS, num_warps=8,
                )  # fmt: skip
                self.events[layer].record(stream)

    @property
    def done(self) -> torch.cuda.Event:
        return self.events[-1]

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until `layer` of every target block is written."""
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)
