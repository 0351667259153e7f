"""How one forward pass's chunks map onto the paged KV cache: validated and planned once per
forward, then read by every layer.

A batch holds one `SeqChunk` per sequence: the new tokens, where they start, and the block table
that maps the sequence's positions to cache blocks.

      sequence positions:  0 ........... start_pos ........ start_pos + len(token_ids)
                           |-- in cache --|---- new tokens (KV written now) ----|
      block_table[j] holds positions [j * block_size, (j + 1) * block_size)
      slot(p) = block_table[p // block_size] * block_size + p % block_size

All chunks' tokens are flattened into one token dimension ("rows", varlen layout). For attention the
plan sorts chunks three ways, each served by the cheapest correct SDPA call:
  * fresh prefill (start_pos == 0): the new K/V alone under a plain causal mask;
  * decode (one token behind a cached prefix): all such chunks in one call, their blocks gathered
    and right-padded to the longest, a padding mask per row;
  * chunked prefill (several tokens behind a cached prefix): one call per chunk over its gathered
    blocks, with the causal mask shifted by start_pos.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """New tokens of one sequence to run, and where its KV lives."""

    token_ids: Sequence[int]
    """The new tokens (at least one); their K/V is written to the cache."""
    start_pos: int
    """Tokens of this sequence already in the cache; the new tokens take positions from here."""
    block_table: Sequence[int]
    """Block ids holding positions [0, start_pos + len(token_ids)); extra trailing ids are fine."""

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
class CachedChunk:
    """A multi-token chunk behind a cached prefix: attends to gathered keys under a shifted mask."""

    rows: slice
    block_ids: torch.Tensor  # [ceil(end_pos / block_size)] blocks holding positions 0..end_pos-1
    mask: torch.Tensor  # [num_queries_per_kv * num_new, end_pos]; True = may attend


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


def validate_batch(
    batch: Sequence[SeqChunk],
    *,
    num_blocks: int,
    block_size: int,
    vocab_size: int,
    context_len: int,
) -> None:
    """Raise ValueError, with the numbers, for any chunk the cache or the model cannot run."""
    if not batch:
        raise ValueError("batch is empty")
    for i, chunk in enumerate(batch):
        num_blocks_needed = -(-chunk.end_pos // block_size)
        if len(chunk.block_table) < num_blocks_needed:
            raise ValueError(
                f"chunk {i}: block table has {len(chunk.block_table)} blocks, "
                f"{chunk.end_pos} tokens need {num_blocks_needed} of {block_size}"
            )
        low, high = min(chunk.block_table), max(chunk.block_table)
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


def plan_batch(
    batch: Sequence[SeqChunk], *, block_size: int, num_queries_per_kv: int, device: torch.device
) -> BatchPlan:
    """Index tensors for a validated batch (see `validate_batch`), moved to `device` once."""
    bs = block_size
    tables = [torch.tensor(c.block_table, dtype=torch.int64) for c in batch]
    positions = [torch.arange(c.start_pos, c.end_pos) for c in batch]
    slots = torch.cat([t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)])
    if len(batch) > 1 and torch.unique(slots).numel() != slots.numel():
        raise ValueError(f"chunks write {slots.numel()} tokens into fewer distinct cache slots")
    token_ids = torch.tensor([t for c in batch for t in c.token_ids])
    host = torch.stack([token_ids, torch.cat(positions), slots]).to(device, non_blocking=True)
    chunk_lens = [len(c.token_ids) for c in batch]
    ends = list(itertools.accumulate(chunk_lens))
    fresh, cached, decode_indices = [], [], []
    for i, chunk in enumerate(batch):
        rows = slice(ends[i] - chunk_lens[i], ends[i])
        if chunk.start_pos == 0:
            fresh.append(rows)
        elif chunk_lens[i] == 1:
            decode_indices.append(i)
        else:
            cached.append(_cached_chunk(chunk, tables[i], rows, bs, num_queries_per_kv, device))
    decode = None
    if decode_indices:
        decode = _decode_group(
            [batch[i] for i in decode_indices],
            [tables[i] for i in decode_indices],
            [ends[i] - 1 for i in decode_indices],
            bs,
            device,
        )
    return BatchPlan(
        token_ids=host[0],
        positions=host[1],
        write_slots=host[2],
        last_rows=torch.tensor(ends, device=device) - 1,
        chunk_lens=chunk_lens,
        fresh=fresh,
        cached=cached,
        decode=decode,
    )


def _cached_chunk(
    chunk: SeqChunk,
    table: torch.Tensor,
    rows: slice,
    block_size: int,
    num_queries_per_kv: int,
    device: torch.device,
) -> CachedChunk:
    query_pos = torch.arange(chunk.start_pos, chunk.end_pos, device=device)
    key_pos = torch.arange(chunk.end_pos, device=device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [num_new, end_pos]
    # Rows are (g, i): query head g of a KV group, token i. So the causal block repeats g times.
    mask = causal.repeat(num_queries_per_kv, 1)
    num_blocks = -(-chunk.end_pos // block_size)
    return CachedChunk(rows, table[:num_blocks].to(device), mask)


def _decode_group(
    chunks: list[SeqChunk],
    tables: list[torch.Tensor],
    rows: list[int],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    """Blocks of all decoding chunks, right-padded to the longest with block 0 (masked out)."""
    lens = [c.end_pos for c in chunks]
    max_blocks = -(-max(lens) // block_size)
    padded = torch.zeros((len(chunks), max_blocks), dtype=torch.int64)
    for row, (table, length) in enumerate(zip(tables, lens, strict=True)):
        needed = -(-length // block_size)
        padded[row, :needed] = table[:needed]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens_dev = torch.tensor(lens, device=device)
    mask = (key_pos[None, :] < lens_dev[:, None]).view(len(chunks), 1, 1, -1)
    rows_dev = torch.tensor(rows, device=device)
    return DecodeGroup(rows_dev, padded.flatten().to(device), mask)
