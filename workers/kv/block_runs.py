"""The order, and at the edges the choice, of the blocks one allocation hands out: in runs.

cuDNN reads a chunk's cache in pages of several blocks wherever each group of `run_blocks`
entries of its block table is a run of consecutive blocks (`cudnn_pages.blocks_per_page`), and
faster so. Which free blocks an allocation takes is the pool's LRU order; the order it hands
them out in is free to choose, and ascending keeps a run freed together a run. Where the blocks
taken are pieces (a busy pool's decode blocks, allocated one at a time beside other sequences'),
a piece whose length is no whole number of groups breaks the table at its end. Then each such
piece but one grows to whole groups by the free blocks right beside it, and the piece handed out
last (its end is the table's) gives back as many from its end, which stay free and first in line:

    taken (LRU)   [40..74] [100..148] [300..303]        35 + 49 + 4 = 88 blocks, groups of 4
    handed out    [40..75] [300..303] [100..147]        36 + 4 + 48 = 88; block 75 was free
                                                        beside the first piece, 148 stays free

Only ordinary free blocks are taken beside a piece (never a protected or used one); where none
are, the blocks go out ascending as taken.

A prompt's cached blocks come as they were cached: a prefix that ends inside a group (a shared
system prompt of any length), or that holds an earlier answer's blocks (decoded one at a time),
breaks its table there, and then the whole chunk is read one block a page. `relocated_tail` says
how many of its last cached blocks to copy into fresh ones, handed out with its new blocks, so
that every group is a run again:

    cached       [40 41 42 43] [60 61 62]            the prefix ends inside group 1
    table        [40 41 42 43] [80 81 82 83 ...]     60..62 copied into 80..82; the new
                                                     blocks go on from 83 in the same run
    cached       [40 41 42 43] [60 61 9 15] [22]     an answer's blocks break group 1
    table        [40 41 42 43] [80 81 82 83] [84 ...]   all from group 1 on copied

Copying a token's K and V (4 KiB a layer for Llama-3-8B, read and written at ~3 TB/s) costs
what cuDNN saves on ~400 (query, key) pairs by reading 64-token pages (482 TFLOP/s against 403
scattered, H100): the tail is copied only while its tokens times `RELOCATION_PAIRS_PER_TOKEN`
stay within the chunk's new tokens times its cached ones. The copies take the originals' hashes
over once written (`BlockPool.take_over`), so the next turn finds the chain in runs.

A copy pays only where it makes the whole table runs: if the new blocks themselves come in
pieces (a busy pool), the chunk is read one block a page all the same, and a copy of a block
other sequences still read would only hold a second block as long as the sequence runs (on a
busy worker that cost cached tokens: `all_runs` over the table the allocation would give, first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["RELOCATION_PAIRS_PER_TOKEN", "all_runs", "in_runs", "relocated_tail"]

RELOCATION_PAIRS_PER_TOKEN = 512
"""(query, key) pairs whose faster read pays for copying one cached token (module doc)."""


def in_runs(
    taken: Sequence[int], run_blocks: int, spare: Callable[[int], bool], num_blocks: int
) -> list[int]:
    """The blocks to hand out for an allocation whose LRU order takes `taken`, in table order:
    as many, each group of `run_blocks` (the last may be short) a run where the free blocks
    beside the pieces allow (module doc), else `taken` ascending. `spare(b)`: block b is an
    ordinary free block the allocation may take instead."""
    blocks = sorted(taken)
    if run_blocks <= 1 or len(blocks) <= run_blocks:
        return blocks
    runs = _runs(blocks)
    broken = [i for i, (_, length) in enumerate(runs) if length % run_blocks]
    if not broken:
        return blocks
    last = max(broken, key=lambda i: runs[i][1])
    held = set(blocks)
    extra = 0
    for i in broken:
        if i == last:
            continue
        start, length = runs[i]
        need = run_blocks - length % run_blocks
        after = range(start + length, start + length + need)
        before = range(start - need, start)
        if _all_spare(after, held, spare, num_blocks):
            runs[i] = (start, length + need)
            held.update(after)
        elif _all_spare(before, held, spare, num_blocks):
            runs[i] = (start - need, length + need)
            held.update(before)
        else:
            return blocks
        extra += need
    start, length = runs[last]
    if length <= extra:
        return blocks
    runs[last] = (start, length - extra)
    ordered = [run for i, run in enumerate(runs) if i != last] + [runs[last]]
    return [b for start, length in ordered for b in range(start, start + length)]


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Ascending blocks as (first block, length) of each run of consecutive ones."""
    runs: list[tuple[int, int]] = []
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1:
            runs.append((start, prev - start + 1))
            start = b
        prev = b
    runs.append((start, prev - start + 1))
    return runs


def _all_spare(
    blocks: range, held: set[int], spare: Callable[[int], bool], num_blocks: int
) -> bool:
    return all(0 <= b < num_blocks and b not in held and spare(b) for b in blocks)


def all_runs(table: Sequence[int] | np.ndarray, run_blocks: int) -> bool:
    """Every group of `run_blocks` entries of `table` (the last may be shorter) is a run of
    consecutive blocks: cuDNN reads the table in pages of that many blocks."""
    return bool(_group_runs(table, run_blocks).all())


def _group_runs(table: Sequence[int] | np.ndarray, run_blocks: int) -> np.ndarray:
    """Per group of `run_blocks` entries of `table` (the last may be shorter): whether it is a
    run of consecutive blocks."""
    blocks = np.asarray(table, dtype=np.int64)
    if run_blocks <= 1 or blocks.size == 0:
        return np.ones(blocks.size, dtype=bool)
    group = np.arange(blocks.size) // run_blocks
    apart = blocks - blocks[group * run_blocks] != np.arange(blocks.size) % run_blocks
    broken = np.zeros(-(-blocks.size // run_blocks), dtype=bool)
    broken[group[apart]] = True
    return ~broken


def relocated_tail(cached: Sequence[int], run_blocks: int, num_new_tokens: int) -> int:
    """How many of a prompt's last cached blocks (`cached`, in table order) to copy into fresh
    ones so that its table can go in runs of `run_blocks`: those from the first group that is
    not a run, a group cut by the prefix's end included; 0 where every group is whole, or where
    the copy would cost more than the faster read saves (module doc)."""
    num_cached = len(cached)
    if run_blocks <= 1 or num_cached == 0 or num_new_tokens <= 0:
        return 0
    whole = num_cached - num_cached % run_blocks
    runs = _group_runs(cached[:whole], run_blocks)
    first = whole if runs.all() else int(np.argmin(runs)) * run_blocks
    tail = num_cached - first
    if tail * RELOCATION_PAIRS_PER_TOKEN > num_new_tokens * num_cached:
        return 0  # (both sides in blocks of cached tokens)
    return tail
