"""How one forward pass's chunks map onto the paged KV cache: validated and planned once per
forward, then read by every layer.

A batch holds one `SeqChunk` per sequence: the new tokens, where they start, and the block table
that maps the sequence's positions to cache blocks.

      sequence positions:  0 ........... start_pos ........ start_pos + len(token_ids)
                           |-- in cache --|---- new tokens (KV written now) ----|
      block_table[j] holds positions [j * block_size, (j + 1) * block_size)
      slot(p) = block_table[p // block_size] * block_size + p % block_size

All chunks' tokens are flattened into one token dimension ("rows", varlen layout). For attention the
plan sorts chunks three ways:
  * fresh prefill (start_pos == 0): the new K/V alone under a plain causal mask (flash SDPA);
  * decode (one token behind a cached prefix): all such chunks in one call;
  * chunked prefill (several tokens behind a cached prefix): causal mask shifted by start_pos.
The last two read the cache. With `AttentionMode.paged_*` they go to the paged Triton kernel (one
launch each, straight from the block tables); otherwise to SDPA over gathered blocks: decode
right-padded to the longest with a padding mask, chunked prefill one call per chunk. With
`AttentionMode.bucketed_prefill` a chunked prefill behind a long prefix is attended in two merged
parts instead (`split_attention`: unmasked on cuDNN at bucketed shapes, a causal tail on flash),
or, with `AttentionMode.cudnn_pages` too, in one cuDNN call reading the cache in place
(`cudnn_pages`).

Planning runs on the host for every step, so it sticks to Python integers and numpy and crosses to
the device in a few packed transfers; nothing in a layer waits on the host.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.workers.model.cudnn_pages import ChunkPages
from kvmesh.workers.model.paged_attention import (
    DECODE_TILE,
    PREFILL_TILE,
    PagedChunk,
    PagedLayout,
    TileShape,
    build_paged_layout,
)
from kvmesh.workers.model.split_attention import SplitShape


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """New tokens of one sequence to run, and where its KV lives."""

    token_ids: Sequence[int]
    """The new tokens (at least one); their K/V is written to the cache."""
    start_pos: int
    """Tokens of this sequence already in the cache; the new tokens take positions from here."""
    block_table: Sequence[int]
    """Block ids holding positions [0, start_pos + len(token_ids)); extra trailing ids are fine."""
    adapter: str = ""
    """LoRA adapter the sequence runs with ("" = the base model)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) < 1:
            raise ValueError("a chunk needs at least 1 new token, got 0")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")

    @property
    def end_pos(self) -> int:
        """Sequence length once this chunk has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class AttentionMode:
    """Which attention path serves the chunks that read cached K/V."""

    paged_decode: bool
    """Decode chunks through the paged Triton kernel (else gathered blocks + padded SDPA)."""
    paged_prefill: bool
    """Chunked prefills through the paged Triton kernel (else gathered blocks + SDPA per chunk)."""
    explicit_masks: bool
    """SDPA paths take boolean masks (CPU); else a lower-right causal bias (CUDA flash kernels)."""
    split_prefill: bool = False
    """Chunked prefills not on the paged kernel split at the prefix boundary into the unmasked
    prefix (one fused call with its log-sum-exp) and the causal square of the new tokens, merged
    exactly (`split_attention`); else one SDPA call under a shifted causal mask."""
    bucketed_prefill: bool = False
    """Chunked prefills of at least `BUCKETED_MIN_NEW` tokens behind a prefix of at least
    `BUCKETED_MIN_PREFIX` split at a bucketed point with padded rows (`SplitShape.bucketed`: few
    cuDNN plans); other chunks take the paths above."""
    cudnn_pages: bool = False
    """The chunks `bucketed_prefill` picks are attended by cuDNN reading the paged cache in
    place (`cudnn_pages`: one call, no gathers, no merge) instead of split; so is a step's only
    chunk from `SOLE_CHUNK_MIN_NEW` new tokens."""


BUCKETED_MIN_PREFIX = 2048
"""Below this many cached tokens the unmasked part is too small for cuDNN to beat the paged
kernel by more than its extra launches."""
BUCKETED_MIN_NEW = 512
"""Below this many new tokens the split's extra launches (gather, fold, two attention calls,
merge) cost more than cuDNN saves: on an H100, chunks of 54-460 tokens behind 2.4-7.3K cached
ran 1.0-2.2x slower split than on the paged kernel, chunks of 512-682 tokens 0.75-0.98x
(docs/benchmarks.md)."""
SOLE_CHUNK_MIN_NEW = 16
"""With `cudnn_pages`, a step's only chunk goes to cuDNN over the pages from this many new
tokens (behind >= `BUCKETED_MIN_PREFIX`): one call a layer, nothing gathered, and the step
replays as a CUDA graph (`prefill_graphs`) instead of issuing ~400 kernels from Python. On an
H100 (Llama-3-8B shape, behind 8,192 cached) 16, 64, 256 and 511 new tokens took 11.5, 11.4,
12.9 and 18.4 ms so, against 13.1, 12.3, 14.7 and 21.8 on the paged kernel (docs/benchmarks.md).
Chunks sharing a step stay on the paged kernel below `BUCKETED_MIN_NEW`: it reads them all in
one launch a layer, where cuDNN takes one call a chunk."""


@dataclass(frozen=True, slots=True)
class CachedChunk:
    """A multi-token chunk behind a cached prefix: attends to gathered keys, causally shifted."""

    rows: slice
    end_pos: int
    block_ids: torch.Tensor  # [ceil(end_pos / block_size)] blocks holding positions 0..end_pos-1
    # (on cuDNN's pages: the page table's entries, `ChunkPages.page_ids`)
    start_pos: int  # cached prefix length: the new tokens are positions [start_pos, end_pos)
    mask: torch.Tensor | None  # [num_queries_per_kv * num_new, end_pos]; True = may attend
    split: SplitShape | None = None  # set: attended as two merged parts (`split_attention`)
    pages: ChunkPages | None = None  # set: attended by cuDNN over the paged cache (`cudnn_pages`)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Single-token chunks behind a cached prefix, attended in one padded SDPA call."""

    rows: torch.Tensor  # [num_seqs] flattened-token row of each chunk's token
    block_ids: torch.Tensor  # [num_seqs * max_blocks] each row's blocks, padded with block 0
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size]; True = a real position


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Everything about a batch that does not change from layer to layer; tensors on the device."""

    token_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    write_slots: torch.Tensor  # [num_tokens] where each new token's K/V goes
    last_rows: torch.Tensor  # [num_chunks] row of each chunk's last token
    chunk_lens: list[int]
    fresh: list[slice]
    cached: list[CachedChunk]
    decode: DecodeGroup | None
    paged: list[PagedLayout]
    """Launches of the paged kernel (decode and/or chunked prefill)."""


def validate_batch(
    batch: Sequence[SeqChunk],
    *,
    num_blocks: int,
    block_size: int,
    vocab_size: int,
    context_len: int,
    check_tables: bool = True,
) -> None:
    """Raise ValueError, with the numbers, for any chunk the cache or the model cannot run.
    `check_tables=False` leaves out the range of the tables' block ids (a caller that checks
    the ids it copies, as the decode graphs do)."""
    if not batch:
        raise ValueError("batch is empty")
    for i, chunk in enumerate(batch):
        num_blocks_needed = -(-chunk.end_pos // block_size)
        if len(chunk.block_table) < num_blocks_needed:
            raise ValueError(
                f"chunk {i}: block table has {len(chunk.block_table)} blocks, "
                f"{chunk.end_pos} tokens need {num_blocks_needed} of {block_size}"
            )
        low, high = (min(chunk.block_table), max(chunk.block_table)) if check_tables else (0, 0)
        if low < 0 or high >= num_blocks:
            raise ValueError(
                f"chunk {i}: block ids span [{low}, {high}], pool has [0, {num_blocks})"
            )
        low, high = min(chunk.token_ids), max(chunk.token_ids)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"chunk {i}: token ids span [{low}, {high}], vocab is {vocab_size}")
        if chunk.end_pos > context_len:
            raise ValueError(
                f"chunk {i}: reaches {chunk.end_pos} tokens, model context is {context_len}"
            )


def _write_slots(chunk: SeqChunk, block_size: int) -> np.ndarray:
    """Cache slot of each new token (see the module doc for the formula)."""
    bs, start = block_size, chunk.start_pos
    if len(chunk.token_ids) == 1:  # decode: plain integers beat any array machinery
        return np.array([chunk.block_table[start // bs] * bs + start % bs], dtype=np.int64)
    table = np.asarray(chunk.block_table[: -(-chunk.end_pos // bs)], dtype=np.int64)
    positions = np.arange(start, chunk.end_pos, dtype=np.int64)
    return table[positions // bs] * bs + positions % bs


def _sort_chunks(batch: Sequence[SeqChunk]) -> tuple[list[int], list[int], list[int]]:
    """Indices of the fresh, chunked-prefill and decode chunks (see the module doc)."""
    fresh, cached, decode = [], [], []
    for i, chunk in enumerate(batch):
        if chunk.start_pos == 0:
            fresh.append(i)
        elif len(chunk.token_ids) == 1:
            decode.append(i)
        else:
            cached.append(i)
    return fresh, cached, decode


def _paged_layout(
    batch: Sequence[SeqChunk],
    indices: list[int],
    ends: list[int],
    block_size: int,
    num_queries_per_kv: int,
    *,
    tile: TileShape,
    device: torch.device,
) -> PagedLayout:
    chunks = []
    for i in indices:
        query_len = len(batch[i].token_ids)
        row = ends[i] - query_len
        chunks.append(PagedChunk(batch[i].end_pos, query_len, row, batch[i].block_table))
    return build_paged_layout(
        chunks,
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        tile=tile,
        device=device,
    )


def plan_batch(
    batch: Sequence[SeqChunk],
    *,
    block_size: int,
    num_queries_per_kv: int,
    device: torch.device,
    mode: AttentionMode,
    num_blocks: int = 0,
) -> BatchPlan:
    """Index tensors for a validated batch (see `validate_batch`), moved to `device` once; with
    the cache's `num_blocks`, cuDNN's pages span runs of blocks where a chunk's allow
    (`cudnn_pages.blocks_per_page`)."""
    slots = np.concatenate([_write_slots(c, block_size) for c in batch])
    if len(batch) > 1 and np.unique(slots).size != slots.size:
        raise ValueError(f"chunks write {slots.size} tokens into fewer distinct cache slots")
    chunk_lens = [len(c.token_ids) for c in batch]
    ends = list(itertools.accumulate(chunk_lens))
    positions = np.concatenate([np.arange(c.start_pos, c.end_pos) for c in batch])
    token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in batch), np.int64)
    packed = np.concatenate([token_ids, positions, slots, np.asarray(ends) - 1])
    host = torch.from_numpy(packed).to(device, non_blocking=True)
    n = len(token_ids)
    fresh, cached_indices, decode_indices = _sort_chunks(batch)
    split_indices = []
    if mode.bucketed_prefill:
        alone = mode.cudnn_pages and len(batch) == 1
        splits = [takes_bucketed_path(batch[i], alone_on_pages=alone) for i in cached_indices]
        split_indices = [i for i, split in zip(cached_indices, splits, strict=True) if split]
        cached_indices = [i for i, split in zip(cached_indices, splits, strict=True) if not split]
    paged = []
    for indices, use_kernel, tile in (
        (decode_indices, mode.paged_decode, DECODE_TILE),
        (cached_indices, mode.paged_prefill, PREFILL_TILE),
    ):
        if indices and use_kernel:
            layout = _paged_layout(
                batch, indices, ends, block_size, num_queries_per_kv, tile=tile, device=device
            )
            paged.append(layout)
    rows = [slice(end - length, end) for end, length in zip(ends, chunk_lens, strict=True)]
    cached = [
        _cached_chunk(batch[i], rows[i], block_size, num_queries_per_kv, device, mode)
        for i in ([] if mode.paged_prefill else cached_indices)
    ]
    if mode.cudnn_pages:
        cached += [
            _pages_chunk(batch[i], rows[i], block_size, device, num_blocks) for i in split_indices
        ]
    else:
        cached += [_split_chunk(batch[i], rows[i], block_size, device) for i in split_indices]
    decode = None
    if decode_indices and not mode.paged_decode:
        decode_rows = [ends[i] - 1 for i in decode_indices]
        decode = _decode_group([batch[i] for i in decode_indices], decode_rows, block_size, device)
    return BatchPlan(
        token_ids=host[:n],
        positions=host[n : 2 * n],
        write_slots=host[2 * n : 3 * n],
        last_rows=host[3 * n :],
        chunk_lens=chunk_lens,
        fresh=[rows[i] for i in fresh],
        cached=cached,
        decode=decode,
        paged=paged,
    )


def _cached_chunk(
    chunk: SeqChunk,
    rows: slice,
    block_size: int,
    num_queries_per_kv: int,
    device: torch.device,
    mode: AttentionMode,
) -> CachedChunk:
    if mode.split_prefill:
        split = SplitShape.exact(chunk.start_pos, len(chunk.token_ids))
        return _split_chunk(chunk, rows, block_size, device, split)
    block_ids = _block_ids(chunk, block_size, device)
    if not mode.explicit_masks:
        return CachedChunk(rows, chunk.end_pos, block_ids, chunk.start_pos, None)
    query_pos = torch.arange(chunk.start_pos, chunk.end_pos, device=device)
    key_pos = torch.arange(chunk.end_pos, device=device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [num_new, end_pos]
    # Rows are (g, i): query head g of a KV group, token i. So the causal block repeats g times.
    mask = causal.repeat(num_queries_per_kv, 1)
    return CachedChunk(rows, chunk.end_pos, block_ids, chunk.start_pos, mask)


def takes_bucketed_path(chunk: SeqChunk, *, alone_on_pages: bool = False) -> bool:
    """A chunk long enough, behind a prefix long enough, for the bucketed split (or cuDNN over
    the pages) to pay; `alone_on_pages`: the step's only chunk, read by cuDNN over the pages
    (`SOLE_CHUNK_MIN_NEW`)."""
    least = SOLE_CHUNK_MIN_NEW if alone_on_pages else BUCKETED_MIN_NEW
    return chunk.start_pos >= BUCKETED_MIN_PREFIX and len(chunk.token_ids) >= least


def _split_chunk(
    chunk: SeqChunk,
    rows: slice,
    block_size: int,
    device: torch.device,
    split: SplitShape | None = None,
) -> CachedChunk:
    """A chunk attended as two merged parts; bucketed unless `split` says otherwise."""
    if split is None:
        split = SplitShape.bucketed(chunk.start_pos, len(chunk.token_ids))
    block_ids = _block_ids(chunk, block_size, device)
    return CachedChunk(rows, chunk.end_pos, block_ids, chunk.start_pos, None, split)


def _pages_chunk(
    chunk: SeqChunk, rows: slice, block_size: int, device: torch.device, num_blocks: int
) -> CachedChunk:
    """A chunk attended by cuDNN straight from the cache (its page table and lengths)."""
    pages = ChunkPages.of(
        chunk.block_table,
        chunk.start_pos,
        len(chunk.token_ids),
        block_size,
        device,
        num_blocks=num_blocks,
    )
    return CachedChunk(rows, chunk.end_pos, pages.page_ids, chunk.start_pos, None, pages=pages)


def _block_ids(chunk: SeqChunk, block_size: int, device: torch.device) -> torch.Tensor:
    """The blocks holding positions 0..end_pos-1, on the device."""
    num_blocks = -(-chunk.end_pos // block_size)
    return torch.tensor(chunk.block_table[:num_blocks], dtype=torch.int64).to(device)


def _decode_group(
    chunks: list[SeqChunk], rows: list[int], block_size: int, device: torch.device
) -> DecodeGroup:
    """Blocks of all decoding chunks, right-padded to the longest with block 0 (masked out)."""
    lens = [c.end_pos for c in chunks]
    max_blocks = -(-max(lens) // block_size)
    padded = torch.zeros((len(chunks), max_blocks), dtype=torch.int64)
    for row, (chunk, length) in enumerate(zip(chunks, lens, strict=True)):
        needed = -(-length // block_size)
        padded[row, :needed] = torch.tensor(chunk.block_table[:needed])
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens_dev = torch.tensor(lens, device=device)
    mask = (key_pos[None, :] < lens_dev[:, None]).view(len(chunks), 1, 1, -1)
    rows_dev = torch.tensor(rows, device=device)
    return DecodeGroup(rows_dev, padded.flatten().to(device), mask)
