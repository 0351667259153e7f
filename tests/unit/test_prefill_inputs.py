"""What a captured prefill step's host buffer holds for one chunk (`prefill_graphs`), checked
against the formulas: the same whether the caller converted the block table or not."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvmesh.workers.model.batch_plan import SeqChunk
from kvmesh.workers.model.cudnn_pages import ChunkPages, PagesBucket
from kvmesh.workers.model.prefill_graphs import _split_inputs, chunk_table, fill_prefill_inputs

BS = 16


def test_a_chunks_rows_slots_and_pages_land_where_the_graph_reads_them() -> None:
    rng = random.Random(3)
    table = rng.sample(range(1000), 45)  # more blocks than the chunk uses, scattered
    start, n = 500, 100  # positions 500..599: blocks 0..37
    tokens = [rng.randrange(50_000) for _ in range(n)]
    chunk = SeqChunk(tokens, start, table)
    converted = chunk_table(chunk, BS)
    assert converted.tolist() == table[:38]
    bucket = PagesBucket.for_chunk(converted, start, n, BS, num_blocks=1000)
    assert bucket == PagesBucket.for_chunk(table, start, n, BS, num_blocks=1000)
    filled = []
    for given in (None, converted):
        ints = np.full((4, bucket.rows), -1, np.int64)
        packed = np.full(ChunkPages.packed_size(bucket), -1, np.int32)
        fill_prefill_inputs(chunk, bucket, BS, ints, packed, given)
        filled.append((ints, packed))
    (ints, packed), (ints2, packed2) = filled
    assert np.array_equal(ints, ints2) and np.array_equal(packed, packed2)
    rows = [min(r, n - 1) for r in range(bucket.rows)]  # padding repeats the last row
    positions = [start + r for r in rows]
    assert ints[0].tolist() == [tokens[r] for r in rows]
    assert ints[1].tolist() == positions
    assert ints[2].tolist() == [table[p // BS] * BS + p % BS for p in positions]
    assert ints[3].tolist() == rows
    assert packed[:38].tolist() == table[:38] and not packed[38 : bucket.pages].any()
    assert packed[bucket.pages] == n and packed[bucket.pages + 4] == start + n


def test_the_ints_and_the_packed_inputs_are_views_of_one_buffer_that_crosses_whole() -> None:
    rows, num_packed = 64, 64 + 8
    buffer = torch.zeros(4 * rows + num_packed // 2, dtype=torch.int64)
    ints, packed = _split_inputs(buffer, rows, num_packed)
    assert tuple(ints.shape) == (4, rows) and tuple(packed.shape) == (num_packed,)
    assert packed.dtype == torch.int32
    assert (packed.data_ptr() - buffer.data_ptr()) % 16 == 0
    ints[3, -1] = 7
    packed[-1] = 9
    assert buffer[4 * rows - 1] == 7
    assert buffer.view(torch.int32)[-1] == 9
