"""Attention of new tokens over K/V that already sits in the paged cache, read through block tables.

One launch serves any mix of chunks whose K/V has been written to the cache: decode steps (one new
token) and chunked prefills behind a cached prefix (many new tokens). Each chunk's new tokens are
the *last* `query_len` positions of its sequence, so causality is bottom-right aligned:

      key positions:   0 ............................... seq_len - 1
      query token i:   position seq_len - query_len + i, sees keys [0, that position]

Grouped-query attention is folded into the rows of a tile: the query heads that share a KV head
become extra rows, so every K/V element is loaded once per tile, not once per query head.

      tile rows (tokens_per_tile x group_pad):  row r = token first + r // group_pad,
                                                       query head kv_head * group + r % group_pad

`PagedLayout` is built once per forward on the host (no device sync) and read by every layer.
The fast path is a Triton kernel (`paged_attention_kernel`, CUDA only, imported lazily so CPU-only
installs never need Triton); `paged_attention_reference` is the slow, obviously-correct oracle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DECODE_TILE",
    "PREFILL_TILE",
    "PagedChunk",
    "PagedLayout",
    "TileShape",
    "build_paged_layout",
    "paged_attention",
    "paged_attention_reference",
]


@dataclass(frozen=True, slots=True)
class TileShape:
    """Kernel tile sizes; a compile-time choice, so one per kind of launch."""

    block_m: int
    """Rows per program: tokens_per_tile x group_pad (at least 16, the tensor-core minimum)."""
    block_n: int
    """Keys per inner-loop step."""
    num_warps: int
    num_stages: int
    min_split_len: int
    """Fewest keys a split of the key range may hold (below this, merging costs more than it
    saves)."""

    def rows(self, group_pad: int) -> int:
        return max(self.block_m, group_pad)

    def tokens_per_tile(self, group_pad: int) -> int:
        return self.rows(group_pad) // group_pad


# Decode: few rows, memory-bound; keys are split across programs to fill the GPU (flash-decoding).
# Swept on an H100 (18 tiles x 1-2 splits at batch 32 x 2K, shuffled 16-token pages): 128 keys a
# step 106.8 us against 110.1 for the 64 before, and at every other shape tried no slower (4 x 8K
# 72.2 against 84.0 us); on an H200 79.6 against 91.8 us (`benchmarks/gpu_kernel.py`).
DECODE_TILE = TileShape(block_m=16, block_n=128, num_warps=4, num_stages=3, min_split_len=256)
# Chunked prefill: many rows reuse each K/V tile, so it is arithmetic-bound like flash attention.
# Swept on an H100 (512 new tokens behind 7,680 cached, 36 tiles x 3 splits,
# `python benchmarks/gpu_kernel.py`): 4 warps 245 us, the earlier 8 warps 301 us.
PREFILL_TILE = TileShape(block_m=128, block_n=64, num_warps=4, num_stages=2, min_split_len=1024)


@dataclass(frozen=True, slots=True)
class PagedChunk:
    """One sequence's new tokens inside the flattened query tensor, and where its K/V lives."""

    seq_len: int
    """Tokens of the sequence in the cache, the new ones included."""
    query_len: int
    """New tokens: the last `query_len` positions of the sequence."""
    query_row: int
    """Row of the first new token in the flattened [num_tokens, heads, dim] query tensor."""
    block_table: Sequence[int]
    """Block ids holding positions [0, seq_len); extra trailing ids are ignored."""


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Device-side index tensors of one launch, plus the host integers that size its grid."""

    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks], padded with block 0 (never read: masked by seq_len)."""
    seq_meta: torch.Tensor
    """int32 [4, num_seqs]: seq_len, query_len, query_row, local_start (row in split buffers)."""
    tile_meta: torch.Tensor
    """int32 [2, num_tiles]: the tile's sequence index, and its first token within the chunk."""
    chunks: tuple[PagedChunk, ...]
    """The host description the tensors came from (the reference reads it)."""
    tile: TileShape
    group_pad: int
    """Query heads per KV head, rounded up to a power of two."""
    num_tiles: int
    num_local_tokens: int
    """New tokens in this launch (rows of the split buffers)."""
    max_seq_len: int


def group_pad(num_queries_per_kv: int) -> int:
    return 1 << (num_queries_per_kv - 1).bit_length()


def build_paged_layout(
    chunks: Sequence[PagedChunk],
    *,
    block_size: int,
    num_queries_per_kv: int,
    tile: TileShape,
    device: torch.device,
) -> PagedLayout:
    """Index tensors for `chunks` (non-empty), copied to `device` in two transfers."""
    if not chunks:
        raise ValueError("a paged launch needs at least one chunk")
    pad = group_pad(num_queries_per_kv)
    per_tile = tile.tokens_per_tile(pad)
    max_blocks = max(-(-c.seq_len // block_size) for c in chunks)
    tables = [list(c.block_table[: -(-c.seq_len // block_size)]) for c in chunks]
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    seq_lens, query_lens, query_rows, local_starts = [], [], [], []
    tile_seqs, tile_firsts = [], []
    local = 0
    for i, c in enumerate(chunks):
        if not 1 <= c.query_len <= c.seq_len:
            raise ValueError(f"chunk {i}: query_len {c.query_len} outside [1, {c.seq_len}]")
        seq_lens.append(c.seq_len)
        query_lens.append(c.query_len)
        query_rows.append(c.query_row)
        local_starts.append(local)
        local += c.query_len
        for first in range(0, c.query_len, per_tile):
            tile_seqs.append(i)
            tile_firsts.append(first)
    meta = torch.tensor([seq_lens, query_lens, query_rows, local_starts], dtype=torch.int32)
    tiles = torch.tensor([tile_seqs, tile_firsts], dtype=torch.int32)
    packed = torch.cat([meta.flatten(), tiles.flatten()]).to(device, non_blocking=True)
    return PagedLayout(
        block_tables=torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True),
        seq_meta=packed[: meta.numel()].view(4, -1),
        tile_meta=packed[meta.numel() :].view(2, -1),
        chunks=tuple(chunks),
        tile=tile,
        group_pad=pad,
        num_tiles=len(tile_seqs),
        num_local_tokens=local,
        max_seq_len=max(seq_lens),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    layout: PagedLayout,
    *,
    num_sms: int,
) -> None:
    """Write attention of `layout`'s query rows of q into the same rows of out (Triton, CUDA).

    q, out: [num_tokens, num_heads, head_dim] (last dim contiguous); k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]. Rows not in the layout are left untouched.
    """
    from kvmesh.workers.model.paged_attention_kernel import launch_paged_attention

    launch_paged_attention(q, k_cache, v_cache, out, layout, num_sms=num_sms)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    layout: PagedLayout,
) -> None:
    """Same contract as `paged_attention`, one sequence at a time in float64 (slow; for tests)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for c in layout.chunks:
        num_blocks = -(-c.seq_len // block_size)
        ids = torch.tensor(list(c.block_table[:num_blocks]), device=k_cache.device)
        keys, values = (
            cache.index_select(0, ids).flatten(0, 1)[: c.seq_len].double()
            for cache in (k_cache, v_cache)
        )
        rows = slice(c.query_row, c.query_row + c.query_len)
        queries = q[rows].double()  # [query_len, heads, dim]
        keys, values = (x.repeat_interleave(group, dim=1) for x in (keys, values))
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / math.sqrt(q.shape[-1])
        query_pos = torch.arange(c.seq_len - c.query_len, c.seq_len, device=q.device)
        key_pos = torch.arange(c.seq_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], -math.inf)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
        out[rows] = attn.to(out.dtype)
