"""How an allocation's blocks are handed out (`block_runs`): ascending, and pieces grown to
whole groups by the free blocks beside them where the table would break inside a group; which
tables are runs (`all_runs`), and the allocation known before it is made
(`BlockPool.next_allocation`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.workers.kv.block_pool import BlockPool
from kvmesh.workers.kv.block_runs import all_runs, in_runs


def _groups_are_runs(blocks: list[int], f: int) -> bool:
    groups = [blocks[i : i + f] for i in range(0, len(blocks), f)]
    return all(g == list(range(g[0], g[0] + len(g))) for g in groups)


def test_pieces_grow_by_the_free_blocks_beside_them_and_the_last_gives_back() -> None:
    taken = [*range(100, 149), *range(40, 75), *range(300, 304)]  # 49 + 35 + 4, LRU order
    got = in_runs(taken, 4, lambda b: True, 1024)
    assert got == [*range(40, 76), *range(300, 304), *range(100, 148)]
    assert _groups_are_runs(got, 4)


def test_a_piece_grows_before_its_start_when_the_blocks_after_are_not_free() -> None:
    taken = [*range(10, 17), *range(50, 59)]  # 7 + 9: the 7 grows, the 9 gives one back
    got = in_runs(taken, 4, lambda b: b != 17, 1024)
    assert got == [*range(9, 17), *range(50, 58)]


def test_runs_freed_together_go_out_ascending_with_a_short_piece_last() -> None:
    assert in_runs([13, 12, 11, 10, 22, 21, 20], 4, lambda b: True, 64) == [
        10, 11, 12, 13, 20, 21, 22
    ]  # fmt: skip
    assert in_runs([1, 2, 3, 10, 11, 12, 13], 4, lambda b: True, 64) == [
        10, 11, 12, 13, 1, 2, 3
    ]  # fmt: skip
    assert in_runs([5, 3, 9], 1, lambda b: True, 64) == [3, 5, 9]  # no groups: ascending


def test_without_free_blocks_beside_them_the_blocks_go_out_ascending_as_taken() -> None:
    taken = [*range(10, 17), *range(50, 59)]
    assert in_runs(taken, 4, lambda b: False, 1024) == sorted(taken)
    # beside the cache's ends there is nothing to take
    assert in_runs([*range(0, 3), *range(50, 59)], 4, lambda b: b < 0, 64) == [
        *range(0, 3), *range(50, 59)
    ]  # fmt: skip
    # the last piece too short to give back what the others took
    assert in_runs([*range(10, 13), *range(20, 23), *range(30, 31)], 4, lambda b: True, 64) == [
        10, 11, 12, 20, 21, 22, 30
    ]  # fmt: skip


@given(
    taken=st.sets(st.integers(min_value=0, max_value=199), min_size=1, max_size=60),
    spare=st.sets(st.integers(min_value=0, max_value=199)),
    f=st.sampled_from([1, 2, 4]),
)
def test_an_allocation_hands_out_as_many_distinct_blocks_from_those_it_may_take(
    taken: set[int], spare: set[int], f: int
) -> None:
    spare -= taken
    got = in_runs(sorted(taken, reverse=True), f, spare.__contains__, 200)
    assert len(got) == len(set(got)) == len(taken)
    assert set(got) <= taken | spare
    if got != sorted(taken):  # reshaped: every group a run, and only then
        assert _groups_are_runs(got, f)
    assert all_runs(got, f) == _groups_are_runs(got, f)


def test_a_table_is_runs_where_every_group_is_one_the_last_may_be_short() -> None:
    assert all_runs([40, 41, 42, 43, 60, 61], 4)
    assert all_runs([5, 6, 7, 8, 9], 4)
    assert not all_runs([40, 41, 42, 43, 60, 62], 4)
    assert not all_runs([41, 40, 42, 43], 4)  # a group must ascend from its first block
    assert all_runs([], 4) and all_runs([9, 3, 7], 1)


def test_the_next_allocation_is_known_before_it_is_made_and_knowing_changes_nothing() -> None:
    pool = BlockPool(32, run_blocks=4)
    held = pool.allocate(32)
    assert held is not None and pool.next_allocation(1) is None
    pool.free(held[1::3])  # pieces: what a busy pool's free queue looks like
    before = (pool.num_free, pool.num_evicted, pool.num_hash_changes)
    peeked = pool.next_allocation(7)
    assert peeked is not None and len(peeked) == 7
    assert (pool.num_free, pool.num_evicted, pool.num_hash_changes) == before
    assert pool.next_allocation(7) == peeked
    assert pool.allocate(7) == peeked
