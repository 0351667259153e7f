"""Copies KV blocks between two paged caches in one kernel launch (CUDA), whatever their order.

Both caches have the layout [layers, 2, num_blocks, block_size, kv_heads, head_dim], so one block
of one layer's K or V is a contiguous slab. The kernel gives each (layer x K/V, block pair) to one
program, which streams its slab from source to destination: a scattered set of blocks moves at
the speed of one large copy, with no staging buffer. Without CUDA (or Triton) the copy falls back
to `copy_block_runs`, one strided copy per run of consecutive blocks.
"""

from __future__ import annotations

import numpy as np
import torch


def copy_block_runs(
    dst_cache: torch.Tensor, dst_ids: list[int], src_cache: torch.Tensor, src_ids: list[int]
) -> int:
    """dst_cache[:, :, dst_ids[i]] = src_cache[:, :, src_ids[i]] for every i, as few strided
    copies as possible: pairs where both sides advance by one block share one slice copy, so a
    fresh pool's consecutive blocks move in one pass at memory bandwidth instead of a gather plus
    a scatter. Returns the number of copies issued.

        src: [7 8 9 | 2 | 3 4]      dst: [10 11 12 | 13 | 20 21]   ->  3 copies
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} sources")
    copies = 0
    i = 0
    while i < len(src_ids):
        j = i + 1
        while (
            j < len(src_ids)
            and src_ids[j] == src_ids[j - 1] + 1
            and dst_ids[j] == dst_ids[j - 1] + 1
        ):
            j += 1
        s0, d0, n = src_ids[i], dst_ids[i], j - i
        dst_cache[:, :, d0 : d0 + n].copy_(src_cache[:, :, s0 : s0 + n], non_blocking=True)
        copies += 1
        i = j
    return copies


try:  # Triton ships with CUDA builds of torch; CPU builds do without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


if triton is not None:
    # One compiled variant serves every copy: Triton would otherwise specialise the block counts
    # on divisibility by 16, and a staging buffer's count changes with every pull, so the first
    # pulls of a deployment would each compile (a few hundred ms on the engine thread).
    @triton.jit(do_not_specialize=["src_num_blocks", "dst_num_blocks"])
    def _copy_blocks_kernel(
        src_ptr,
        dst_ptr,
        src_ids_ptr,
        dst_ids_ptr,
        src_num_blocks,
        dst_num_blocks,
        slab_elems,
        CHUNK: tl.constexpr,
    ):
        slab = tl.program_id(0).to(tl.int64)  # layer x {K, V}
        pair = tl.program_id(1)
        src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
        dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
        src_base = (slab * src_num_blocks + src_block) * slab_elems
        dst_base = (slab * dst_num_blocks + dst_block) * slab_elems
        for start in range(0, slab_elems, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            mask = offs < slab_elems
            values = tl.load(src_ptr + src_base + offs, mask=mask)
            tl.store(dst_ptr + dst_base + offs, values, mask=mask)


class BlockPairs:
    """Which source block goes to which destination block in one copy: as lists, and as one
    int32 device tensor built once per stream (a copy run in layer groups launches the kernel
    once per group over the same pairs). Invariant: `len(src_ids) == len(dst_ids)`."""

    def __init__(self, src_ids: list[int], dst_ids: list[int]) -> None:
        if len(dst_ids) != len(src_ids):
            raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} sources")
        self.src_ids = src_ids
        self.dst_ids = dst_ids
        self._on: tuple[torch.cuda.Stream, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.src_ids)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(source ids, destination ids) on `device`, copied there on the current stream the
        first time it asks (a tensor made on one stream is not used from another)."""
        stream = torch.cuda.current_stream(device)
        n = len(self.src_ids)
        # The destination ids start 16-byte aligned, as the source ids do: Triton specialises
        # pointers on that alignment, and every copy runs the one compiled variant.
        gap = -n % 4
        if self._on is None or self._on[0] != stream:
            ids = np.array(self.src_ids + [0] * gap + self.dst_ids, dtype=np.int32)
            pinned = torch.from_numpy(ids).pin_memory()  # (numpy converts a list ~2x faster)
            self._on = (stream, pinned.to(device, non_blocking=True))
        ids_t = self._on[1]
        return ids_t[:n], ids_t[n + gap :]


def warm_up_block_copy(cache: torch.Tensor) -> None:
    """Compile the copy kernel now (a few hundred ms), not on the first pull: block 0 onto
    itself, which changes nothing."""
    if triton is not None and cache.is_cuda:
        copy_blocks(cache, [0], cache, [0])


def copy_blocks(
    dst_cache: torch.Tensor, dst_ids: list[int], src_cache: torch.Tensor, src_ids: list[int]
) -> None:
    """dst_cache[:, :, dst_ids[i]] = src_cache[:, :, src_ids[i]] for every i."""
    copy_block_pairs(dst_cache, src_cache, BlockPairs(src_ids, dst_ids))


def copy_block_pairs(dst_cache: torch.Tensor, src_cache: torch.Tensor, pairs: BlockPairs) -> None:
    """`copy_blocks` over pairs that may be reused (their device ids are built once)."""
    if dst_cache.shape[:2] != src_cache.shape[:2] or dst_cache.shape[3:] != src_cache.shape[3:]:
        raise ValueError(f"caches differ: {tuple(dst_cache.shape)} vs {tuple(src_cache.shape)}")
    if not len(pairs):
        return
    usable = (
        triton is not None
        and dst_cache.is_cuda
        and src_cache.device == dst_cache.device
        and dst_cache.is_contiguous()
        and src_cache.is_contiguous()
        and dst_cache.dtype == src_cache.dtype
    )
    if not usable:
        copy_block_runs(dst_cache, pairs.dst_ids, src_cache, pairs.src_ids)
        return
    src_t, dst_t = pairs.on(dst_cache.device)
    num_slabs = src_cache.shape[0] * src_cache.shape[1]
    slab_elems = src_cache[0, 0, 0].numel()
    grid = (num_slabs, len(pairs))
    _copy_blocks_kernel[grid](
        src_cache, dst_cache, src_t, dst_t, src_cache.shape[2], dst_cache.shape[2], slab_elems,
        CHUNK=2048,
    )  # fmt: skip
