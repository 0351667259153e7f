"""The host side of the decode graphs: buckets and the inputs a padded step reads (CUDA capture
and replay are checked against eager decode in tests/gpu/test_decode_graphs_gpu.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.workers.model.batch_plan import SeqChunk
from kvmesh.workers.model.decode_graphs import (
    DecodeBucket,
    TableRows,
    batch_sizes,
    decode_bucket,
    fill_decode_inputs,
    is_decode_batch,
)

BS = 16


def buffers(bucket: DecodeBucket) -> tuple[np.ndarray, np.ndarray]:
    ints = np.full((3, bucket.batch), -1, dtype=np.int64)
    meta = np.full(bucket.batch * (bucket.max_blocks(BS) + 6), -1, dtype=np.int32)
    return ints, meta


def test_batch_sizes_cover_every_batch_with_little_padding() -> None:
    assert batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_sizes(8) == (1, 2, 4, 8)
    assert batch_sizes(3) == (1, 2, 3)
    assert batch_sizes(1) == (1,)
    for n in range(1, 65):
        size = next(s for s in batch_sizes(64) if s >= n)
        assert size - n < 8


def test_decode_batches_are_single_token_chunks_behind_a_prefix_without_adapters() -> None:
    assert is_decode_batch([SeqChunk([1], 5, [0]), SeqChunk([2], 1, [1])])
    assert not is_decode_batch([])
    assert not is_decode_batch([SeqChunk([1], 0, [0])])  # a fresh one-token prompt
    assert not is_decode_batch([SeqChunk([1], 5, [0]), SeqChunk([1, 2], 5, [1])])
    assert not is_decode_batch([SeqChunk([1], 5, [0], adapter="a")])


def test_bucket_pads_the_batch_and_rounds_the_context_to_a_power_of_two() -> None:
    batch = [SeqChunk([1], pos, list(range(200))) for pos in (10, 300, 1500)]
    assert decode_bucket(batch, block_size=BS, max_batch=64) == DecodeBucket(4, 2048)
    short = [SeqChunk([1], 3, [0])]
    assert decode_bucket(short, block_size=BS, max_batch=64) == DecodeBucket(1, 256)
    exact = [SeqChunk([1], 2047, list(range(128)))]  # 2,048 tokens fill the 2K bucket exactly
    assert decode_bucket(exact, block_size=BS, max_batch=64) == DecodeBucket(1, 2048)
    assert decode_bucket(batch, block_size=BS, max_batch=2) is None
    odd = decode_bucket(short, block_size=48, max_batch=64)
    assert odd is not None and odd.context % 48 == 0 and odd.context >= 256


def test_inputs_hold_each_row_and_padding_repeats_the_last_chunk() -> None:
    a = SeqChunk([7], 20, [5, 9, 3])  # position 20: block 9, offset 4
    b = SeqChunk([8], 16, [2, 6])  # position 16: first slot of block 6
    c = SeqChunk([9], 33, [1, 4, 11, 12])  # position 33: block 11, offset 1
    bucket = DecodeBucket(4, 256)
    ints, meta = buffers(bucket)
    fill_decode_inputs([a, b, c], bucket, BS, ints, meta)
    assert ints[0].tolist() == [7, 8, 9, 9]
    assert ints[1].tolist() == [20, 16, 33, 33]
    assert ints[2].tolist() == [9 * BS + 4, 6 * BS, 11 * BS + 1, 11 * BS + 1]
    max_blocks = bucket.max_blocks(BS)
    tables = meta[: 4 * max_blocks].reshape(4, max_blocks)
    assert tables[0, :2].tolist() == [5, 9]
    assert tables[1, :2].tolist() == [2, 6]
    assert tables[2, :3].tolist() == [1, 4, 11] == tables[3, :3].tolist()
    seq_meta = meta[4 * max_blocks : 4 * (max_blocks + 4)].reshape(4, 4)
    assert seq_meta.tolist() == [[21, 17, 34, 34], [1, 1, 1, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
    tile_meta = meta[4 * (max_blocks + 4) :].reshape(2, 4)
    assert tile_meta.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]


def test_a_smaller_batch_in_the_same_bucket_overwrites_every_row() -> None:
    bucket = DecodeBucket(4, 256)
    ints, meta = buffers(bucket)
    fill_decode_inputs([SeqChunk([i], 10 + i, [i]) for i in range(4)], bucket, BS, ints, meta)
    fill_decode_inputs([SeqChunk([50], 40, [3, 2, 1])], bucket, BS, ints, meta)
    assert ints.tolist() == [[50] * 4, [40] * 4, [1 * BS + 8] * 4]


@pytest.mark.parametrize("pos", [1, 15, 16, 17, 255])
def test_slot_and_table_prefix_follow_the_block_formula(pos: int) -> None:
    table = list(range(100, 117))
    bucket = DecodeBucket(1, 256)
    ints, meta = buffers(bucket)
    fill_decode_inputs([SeqChunk([3], pos, table)], bucket, BS, ints, meta)
    assert ints[2, 0] == table[pos // BS] * BS + pos % BS
    needed = pos // BS + 1
    assert meta[:needed].tolist() == table[:needed]


def tables_of(bucket: DecodeBucket, meta: np.ndarray) -> np.ndarray:
    max_blocks = bucket.max_blocks(BS)
    return meta[: bucket.batch * max_blocks].reshape(bucket.batch, max_blocks)


def test_rows_remembered_step_to_step_hold_what_a_full_copy_holds() -> None:
    """Sequences decode for many steps, their tables growing a block at a time, the batch
    reordered, a row dropped, a table replaced by a new one (a preempted sequence's): the rows
    a step reads are the ones copying every table would write."""
    rng = random.Random(7)
    bucket = DecodeBucket(8, 1024)
    rows = TableRows(bucket.batch, num_blocks=1000)
    _, remembered = buffers(bucket)
    tables = {s: [rng.randrange(1000)] for s in range(6)}
    positions = dict.fromkeys(tables, 1)
    for step in range(120):
        live = sorted(tables)
        if step % 17 == 0:
            rng.shuffle(live)
        if step == 60:
            live = live[:-1]  # one finished
        if step == 80:
            tables[live[0]] = [rng.randrange(1000) for _ in tables[live[0]]]  # a new table
        for s in live:
            positions[s] += 1
            if positions[s] // BS >= len(tables[s]):
                tables[s].append(rng.randrange(1000))
        batch = [SeqChunk([s], positions[s], tables[s]) for s in live]
        ints, full = buffers(bucket)
        fill_decode_inputs(batch, bucket, BS, ints, full)
        fill_decode_inputs(batch, bucket, BS, ints, remembered, rows)
        for row in range(bucket.batch):
            needed = batch[min(row, len(batch) - 1)].start_pos // BS + 1
            assert (
                tables_of(bucket, remembered)[row, :needed].tolist()
                == tables_of(bucket, full)[row, :needed].tolist()
            ), (step, row)


def test_an_id_outside_the_pool_is_refused_by_chunk_and_the_row_copied_again_later() -> None:
    bucket = DecodeBucket(2, 256)
    rows = TableRows(bucket.batch, num_blocks=50)
    ints, meta = buffers(bucket)
    good, bad = [1, 2], [3, 50]
    with pytest.raises(ValueError, match=r"chunk 1: block ids span \[3, 50\], pool has \[0, 50\)"):
        fill_decode_inputs(
            [SeqChunk([1], 20, good), SeqChunk([1], 20, bad)], bucket, BS, ints, meta, rows
        )
    bad[1] = 7  # (a table is append-only in the engine; here: the same list, now valid)
    fill_decode_inputs(
        [SeqChunk([1], 20, good), SeqChunk([1], 20, bad)], bucket, BS, ints, meta, rows
    )
    assert tables_of(bucket, meta)[:, :2].tolist() == [[1, 2], [3, 7]]
