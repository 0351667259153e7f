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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["in_runs"]


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
