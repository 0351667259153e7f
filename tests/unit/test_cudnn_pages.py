"""cuDNN's paged prefill, its pure parts: which bucket (plan) serves a chunk, what a chunk's
inputs hold, and where the batch plan sends long chunks when the mode asks for it."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.workers.model import batch_plan
from kvmesh.workers.model.batch_plan import AttentionMode, BatchPlan, SeqChunk, plan_batch
from kvmesh.workers.model.cudnn_pages import (
    MIN_PAGES,
    MIN_ROWS,
    ChunkPages,
    PagesBucket,
    blocks_per_page,
    cudnn_pages_usable,
)

CPU = torch.device("cpu")


def test_a_bucket_rounds_rows_and_pages_up_to_powers_of_two() -> None:
    assert PagesBucket.of(512, 496) == PagesBucket(512, 512)
    assert PagesBucket.of(300, 438) == PagesBucket(512, 512)
    assert PagesBucket.of(513, 513) == PagesBucket(1024, 1024)
    assert PagesBucket.of(1, 1) == PagesBucket(MIN_ROWS, MIN_PAGES)


def test_every_chunk_in_the_warm_range_finds_its_bucket_warmed() -> None:
    block = 16
    buckets = set(
        PagesBucket.all_buckets(
            min_prefix=2048, max_len=16384, min_new=512, max_new=2048, block_size=block
        )
    )
    # rows 512 / 1024 / 2048; 16-token pages 256 / 512 / 1024, 64-token pages 64 / 128 / 256
    assert len(buckets) == 18
    rng = random.Random(3)
    for new in (512, 600, 1023, 1024, 2048):
        for prefix in range(2048, 16384 - new + 1, 509):
            used = -(-(prefix + new) // block)
            runs = list(range(used))
            scattered = rng.sample(range(1024), used)
            for table, f in ((runs, 4), (scattered, 1)):
                bucket = PagesBucket.for_chunk(table, prefix, new, block, num_blocks=1024)
                assert bucket.page_blocks == f and bucket in buckets, (new, prefix, f)
    assert (
        PagesBucket.all_buckets(
            min_prefix=2048, max_len=2500, min_new=512, max_new=2048, block_size=block
        )
        == []
    )


def test_chunk_inputs_hold_the_table_padded_and_both_lengths() -> None:
    table = list(range(900, 900 + 40))
    pages = ChunkPages.of(table, 500, 100, 16, CPU)  # 600 tokens: 38 blocks
    assert pages.bucket == PagesBucket(128, 64)
    assert pages.packed.dtype == torch.int32 and pages.packed.numel() == 64 + 8
    assert pages.page_ids.tolist() == table[:38]
    assert pages.table[38:].eq(0).all()  # padding: block 0, never read
    assert pages.len_q.tolist() == [100] and pages.len_kv.tolist() == [600]
    # 16-byte aligned: cuDNN reads each length as its own tensor
    assert pages.len_q.storage_offset() % 4 == 0 and pages.len_kv.storage_offset() % 4 == 0


def test_blocks_in_runs_make_longer_pages_and_anything_else_one_block_a_page() -> None:
    runs = [9, 10, 11, 12, 100, 101, 102, 103, 41, 42]  # the last run partly used
    assert blocks_per_page(runs, 10, 16, 1024) == 4  # a run may start at any block
    assert blocks_per_page(runs, 8, 32, 1024) == 2  # 32-token blocks: two a page
    assert blocks_per_page(runs, 10, 64, 1024) == 1  # blocks as long as a page already
    assert blocks_per_page(runs, 10, 48, 1024) == 1  # a page is no whole number of blocks
    assert blocks_per_page(runs[:8] + [42, 41], 10, 16, 1024) == 1  # out of order
    assert blocks_per_page([8, 9, 10, 12], 4, 16, 1024) == 1  # a gap
    assert blocks_per_page([7, 8, 9, 10, 11, 12], 6, 16, 1024) == 4  # one run, two pages
    assert blocks_per_page([20, 21, 7, 8, 9, 10], 6, 16, 1024) == 1  # runs across a page
    # only the blocks in use count: what follows them in the table is never read
    assert blocks_per_page([8, 9, 10, 11, 5], 4, 16, 1024) == 4
    # a page must lie whole inside the cache, even where the chunk uses part of it
    assert blocks_per_page([1019, 1020], 2, 16, 1022) == 1
    assert blocks_per_page([1018, 1019], 2, 16, 1022) == 4
    # without the cache's size (0): one block a page
    assert PagesBucket.for_chunk(runs, 100, 50, 16).page_blocks == 1


def test_a_table_of_runs_names_each_page_by_its_first_block() -> None:
    table = [9, 10, 11, 12, 100, 101, 102, 103, 40, 41, 42]
    pages = ChunkPages.of(table, 100, 60, 16, CPU, num_blocks=1024)  # 160 tokens: 10 blocks
    assert pages.bucket == PagesBucket(MIN_ROWS, MIN_PAGES, 4)
    assert pages.page_ids.tolist() == [9, 100, 40]
    assert pages.table[3:].eq(0).all()
    assert pages.len_q.tolist() == [60] and pages.len_kv.tolist() == [160]
    # every token position lands in the same block through either table
    for pos in range(160):
        page, offset = divmod(pos, 64)
        assert pages.page_ids[page] + offset // 16 == table[pos // 16], pos


def test_the_plan_reads_runs_as_longer_pages_given_the_caches_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 32)
    batch = [SeqChunk(list(range(20)), 40, list(range(100, 104)))]
    for num_blocks, f in ((1024, 4), (0, 1)):
        (chunk,) = _bucketed_plan(batch, cudnn=True, num_blocks=num_blocks).cached
        assert chunk.pages is not None and chunk.pages.bucket.page_blocks == f


def test_the_plan_sends_long_chunks_to_cudnn_when_the_mode_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 32)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 8)
    batch = [
        SeqChunk(list(range(10)), 40, list(range(100, 104))),  # long enough: cuDNN
        SeqChunk(list(range(5)), 40, list(range(200, 203))),  # too few new tokens: paged
        SeqChunk([1], 60, list(range(300, 304))),  # decode
    ]
    for cudnn in (False, True):
        (chunk,) = _bucketed_plan(batch, cudnn).cached
        assert chunk.rows == slice(0, 10) and chunk.end_pos == 50
        assert chunk.block_ids.tolist() == [100, 101, 102, 103]
        assert (chunk.pages is not None) == cudnn and (chunk.split is not None) != cudnn
        if chunk.pages is not None:
            assert chunk.pages.len_q.tolist() == [10] and chunk.pages.len_kv.tolist() == [50]


def test_not_usable_off_cuda() -> None:
    assert not cudnn_pages_usable(CPU)


def test_a_steps_only_chunk_goes_to_cudnn_from_fewer_new_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 32)
    short = SeqChunk(list(range(batch_plan.SOLE_CHUNK_MIN_NEW)), 40, list(range(100, 104)))
    shorter = SeqChunk(short.token_ids[1:], 40, list(range(100, 104)))
    beside = SeqChunk(list(range(20)), 40, list(range(200, 204)))

    def on_pages(batch: list[SeqChunk], cudnn: bool) -> list[bool]:
        return [chunk.pages is not None for chunk in _bucketed_plan(batch, cudnn).cached]

    assert on_pages([short], cudnn=True) == [True]  # alone: one call a layer, and a graph
    assert on_pages([shorter], cudnn=True) == []  # below the floor: the paged kernel
    assert on_pages([short, beside], cudnn=True) == []  # sharing a step: the paged kernel
    assert on_pages([short], cudnn=False) == []  # the split keeps BUCKETED_MIN_NEW


def _bucketed_plan(batch: list[SeqChunk], cudnn: bool, num_blocks: int = 0) -> BatchPlan:
    """The plan of a runner whose long chunks are bucketed, on cuDNN over the pages or split."""
    mode = AttentionMode(
        paged_decode=True,
        paged_prefill=True,
        explicit_masks=False,
        bucketed_prefill=True,
        cudnn_pages=cudnn,
    )
    return plan_batch(
        batch, block_size=16, num_queries_per_kv=4, device=CPU, mode=mode, num_blocks=num_blocks
    )
