"""Paged attention's host side: the layout the kernel reads, and the slow reference it is checked
against (which must itself equal plain causal attention over contiguous K/V)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvmesh.workers.model.paged_attention import (
    DECODE_TILE,
    PREFILL_TILE,
    PagedChunk,
    build_paged_layout,
    paged_attention_reference,
)

CPU = torch.device("cpu")


def test_layout_packs_sequences_and_cuts_chunks_into_tiles() -> None:
    chunks = [PagedChunk(40, 40, 0, [3, 1, 4]), PagedChunk(9, 1, 40, [2, 7, 7, 7])]
    # group 4 -> 4 padded heads; 128 rows per prefill tile -> 32 tokens per tile.
    layout = build_paged_layout(
        chunks, block_size=16, num_queries_per_kv=4, tile=PREFILL_TILE, device=CPU
    )
    assert layout.num_tiles == 3 and layout.num_local_tokens == 41 and layout.max_seq_len == 40
    assert layout.seq_meta.tolist() == [[40, 9], [40, 1], [0, 40], [0, 40]]
    assert layout.tile_meta.tolist() == [[0, 0, 1], [0, 32, 0]]
    # Only the blocks a sequence reaches are kept; shorter tables are padded with block 0.
    assert layout.block_tables.tolist() == [[3, 1, 4], [2, 0, 0]]
    assert layout.block_tables.dtype == torch.int32


def test_group_of_seven_pads_to_eight_rows_per_token() -> None:
    layout = build_paged_layout(
        [PagedChunk(5, 5, 0, [0])],
        block_size=16,
        num_queries_per_kv=7,
        tile=DECODE_TILE,
        device=CPU,
    )
    assert layout.group_pad == 8 and layout.num_tiles == 3  # 16 rows / 8 = 2 tokens per tile


def test_layout_rejects_more_new_tokens_than_the_sequence_holds() -> None:
    with pytest.raises(ValueError, match=r"query_len 6 outside \[1, 5\]"):
        build_paged_layout(
            [PagedChunk(5, 6, 0, [0])],
            block_size=4,
            num_queries_per_kv=1,
            tile=DECODE_TILE,
            device=CPU,
        )
    with pytest.raises(ValueError, match="at least one chunk"):
        build_paged_layout([], block_size=4, num_queries_per_kv=1, tile=DECODE_TILE, device=CPU)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_reference_equals_causal_attention_over_contiguous_kv(page: int) -> None:
    gen = torch.Generator().manual_seed(page)
    kv_heads, group, dim, seq_len = 2, 3, 8, 37
    keys = torch.randn(seq_len, kv_heads, dim, generator=gen)
    values = torch.randn(seq_len, kv_heads, dim, generator=gen)
    queries = torch.randn(seq_len, kv_heads * group, dim, generator=gen)
    # Scatter the sequence's positions over shuffled blocks of a larger cache.
    num_blocks = -(-seq_len // page)
    table = random.Random(page).sample(range(num_blocks + 5), num_blocks)
    k_cache = torch.randn(num_blocks + 5, page, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    for pos in range(seq_len):
        k_cache[table[pos // page], pos % page] = keys[pos]
        v_cache[table[pos // page], pos % page] = values[pos]
    expected = F.scaled_dot_product_attention(
        queries.transpose(0, 1),
        keys.repeat_interleave(group, dim=1).transpose(0, 1),
        values.repeat_interleave(group, dim=1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    # The whole sequence as one chunk, and its last 5 tokens as a chunk behind a cached prefix.
    for query_len in (seq_len, 5):
        q = torch.zeros(seq_len + 2, kv_heads * group, dim)
        q[2 : 2 + query_len] = queries[seq_len - query_len :]
        layout = build_paged_layout(
            [PagedChunk(seq_len, query_len, 2, table)],
            block_size=page,
            num_queries_per_kv=group,
            tile=PREFILL_TILE,
            device=CPU,
        )
        out = torch.full_like(q, float("nan"))
        paged_attention_reference(q, k_cache, v_cache, out, layout)
        torch.testing.assert_close(out[2 : 2 + query_len], expected[seq_len - query_len :])
        assert out[:2].isnan().all() and out[2 + query_len :].isnan().all()
