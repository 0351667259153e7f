from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockRemoved, BlockStored
from kvmesh.workers.kv.block_pool import BlockId, BlockPool


def H(i: int) -> BlockHash:
    return BlockHash(1000 + i)


def make_pool(n: int = 8) -> BlockPool:
    return BlockPool(n)


def test_free_keeps_prefix_matchable_until_reused() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.register(blocks[0], H(0), BlockHash(0))
    pool.register(blocks[1], H(1), H(0))
    pool.free(blocks)
    pool.check_invariants()
    assert pool.num_free == 4
    assert pool.match_prefix([H(0), H(1), H(2)]) == blocks
    # Two fresh blocks come from the unhashed ones first.
    fresh = pool.allocate(2)
    assert fresh is not None and set(fresh).isdisjoint(blocks)
    assert pool.match_prefix([H(0), H(1)]) == blocks
    pool.check_invariants()


def test_suffix_is_evicted_before_prefix() -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    for i, b in enumerate(blocks):
        pool.register(b, H(i), H(i - 1) if i else BlockHash(0))
    pool.free(blocks)
    pool.allocate(1)  # evicts the tail block
    assert pool.match_prefix([H(0), H(1), H(2)]) == blocks[:2]
    pool.allocate(1)
    assert pool.match_prefix([H(0), H(1), H(2)]) == blocks[:1]
    pool.check_invariants()


def test_blocks_freed_together_come_back_as_an_ascending_run() -> None:
    pool = make_pool(16)
    first = pool.allocate(8)
    second = pool.allocate(8)
    assert first == list(range(8)) and second == list(range(8, 16))
    for seq, blocks in enumerate((first, second)):
        for i, b in enumerate(blocks):
            pool.register(b, H(100 * seq + i), H(100 * seq + i - 1) if i else BlockHash(0))
    pool.free(second)  # tail first: the queue holds 15, 14, ..., 8, then 7, ..., 0
    pool.free(first)
    assert pool.allocate(8) == list(range(8, 16))  # the same blocks, in the order of a run
    assert pool.allocate(4) == list(range(4, 8))  # the least recently freed part of a run
    pool.check_invariants()


def test_pieces_of_an_allocation_grow_to_runs_by_free_blocks_beside_them() -> None:
    pool = BlockPool(32, run_blocks=4)
    first = pool.allocate(32)
    assert first == list(range(32))
    keep = [b for b in first if b not in (*range(3, 7), *range(13, 18))]
    pool.free([3, 4, 5])  # three pieces in the queue's order: 3-5, then 13-17
    pool.free([13, 14, 15, 16, 17])
    pool.register(6, H(6), BlockHash(0))
    pool.free([6])  # beside the first piece, registered: later in line
    got = pool.allocate(8)
    assert got is not None
    # 3-5 grew by 6 (evicting its hash early), 13-17 gave back its last block, still free
    assert got == [3, 4, 5, 6, 13, 14, 15, 16]
    assert pool.ref_count(17) == 0 and pool.num_evicted == 1
    assert pool.allocate(1) == [17]  # what was given back goes first
    pool.free([*keep, *got, 17])
    pool.check_invariants()
    assert pool.num_free == 32


def test_only_reusing_a_registered_block_counts_as_an_eviction() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.register(blocks[0], H(0), BlockHash(0))  # blocks[1] stays unregistered
    pool.free(blocks)
    assert pool.allocate(3) is not None  # two never-used blocks, then the unregistered one
    assert pool.num_evicted == 0
    assert pool.allocate(1) is not None  # only the registered block is left
    assert pool.num_evicted == 1
    pool.check_invariants()


def test_allocate_returns_none_when_short() -> None:
    pool = make_pool(2)
    assert pool.allocate(3) is None
    assert pool.allocate(2) is not None
    assert pool.allocate(1) is None


def test_duplicate_hash_keeps_first_block() -> None:
    pool = make_pool(4)
    a, b = pool.allocate(2) or []
    assert pool.register(a, H(0), BlockHash(0))
    assert not pool.register(b, H(0), BlockHash(0))
    assert pool.match_prefix([H(0)]) == [a]
    pool.check_invariants()


def test_events_record_stores_and_evictions() -> None:
    pool = make_pool(2)
    a, b = pool.allocate(2) or []
    pool.register(a, H(0), BlockHash(0))
    pool.register(b, H(1), H(0))
    assert pool.drain_events() == [BlockStored((H(0), H(1)), 0, BlockHash(0))]
    pool.free([a, b])
    pool.allocate(2)
    events = pool.drain_events()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)
    assert set(events[0].hashes) == {H(0), H(1)}
    assert pool.drain_events() == []


def test_misuse_raises_with_numbers() -> None:
    pool = make_pool(2)
    (a,) = pool.allocate(1) or []
    pool.free([a])
    with pytest.raises(ValueError, match=f"block {a}"):
        pool.free([a])
    with pytest.raises(ValueError, match="is free"):
        pool.register(a, H(0), BlockHash(0))
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="run_blocks"):
        BlockPool(4, run_blocks=0)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / register / acquire / free / evict sequences keep every invariant, and the
    events replayed in order always equal the set of registered hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(12)
        self.seqs: list[list[BlockId]] = []
        self.next_hash = 1
        self.indexed: set[BlockHash] = set()

    def _replay_events(self) -> None:
        for e in self.pool.drain_events():
            if isinstance(e, BlockStored):
                self.indexed |= set(e.hashes)
            elif isinstance(e, BlockRemoved):
                self.indexed -= set(e.hashes)

    @rule(n=st.integers(min_value=0, max_value=5))
    def allocate(self, n: int) -> None:
        before = self.pool.num_free
        blocks = self.pool.allocate(n)
        if n > before:
            assert blocks is None
        else:
            assert blocks is not None and len(blocks) == n
            self.seqs.append(blocks)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(min_value=0), dup=st.booleans())
    def register(self, i: int, dup: bool) -> None:
        seq = self.seqs[i % len(self.seqs)]
        parent = BlockHash(0)
        for b in seq:
            if self.pool.block_hash(b) is None:
                h = BlockHash(self.next_hash - 1 if dup and self.next_hash > 1 else self.next_hash)
                self.next_hash += 1
                self.pool.register(b, h, parent)
            parent = self.pool.block_hash(b) or parent

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(min_value=0))
    def free(self, i: int) -> None:
        self.pool.free(self.seqs.pop(i % len(self.seqs)))

    @rule(k=st.integers(min_value=1, max_value=40))
    def match_and_acquire(self, k: int) -> None:
        hashes = [BlockHash(h) for h in range(max(1, self.next_hash - k), self.next_hash)]
        matched = self.pool.match_prefix(hashes)
        if matched:
            num_free, num_taken = self.pool.num_free, self.pool.num_free_of(matched)
            assert num_taken == sum(self.pool.ref_count(b) == 0 for b in matched)
            self.pool.acquire(matched)
            assert self.pool.num_free == num_free - num_taken
            self.seqs.append(matched)

    @rule()
    def evict_all_free(self) -> None:
        self.pool.evict_all_free()

    @invariant()
    def invariants_hold(self) -> None:
        self.pool.check_invariants()
        self._replay_events()
        assert self.indexed == set(self.pool.cached_hashes())

    def teardown(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        self.pool.check_invariants()
        assert self.pool.num_free == self.pool.num_blocks  # nothing stays referenced


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


class RunPoolMachine(PoolMachine):
    """The same with allocations handed out in runs of three (`block_runs`)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, run_blocks=3)


RunPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestRunPoolMachine = RunPoolMachine.TestCase


def test_stored_events_republish_every_block_with_its_parent_and_depth() -> None:
    pool = make_pool(8)
    root = BlockHash(7)
    blocks = pool.allocate(5)
    assert blocks is not None
    a, b, c, d, e = blocks
    pool.register(a, H(0), root, depth=1)
    pool.register(b, H(1), H(0), depth=2)
    pool.register(c, H(2), H(1), depth=3)
    pool.register(d, H(3), H(0), depth=2)  # a sibling of H(1)
    pool.register(e, H(9), BlockHash(0))  # link unknown
    pool.drain_events()
    events = pool.stored_events()
    links = {}
    for ev in events:
        parent, depth = ev.parent_hash, ev.depth
        for h in ev.hashes:
            links[h] = (parent, depth)
            parent, depth = h, depth + 1 if depth else 0
    assert links == {
        H(0): (root, 1),
        H(1): (H(0), 2),
        H(2): (H(1), 3),
        H(3): (H(0), 2),
        H(9): (BlockHash(0), 0),
    }
    assert len(events) == 3  # [H0 H1 H2], [H3], [H9]: chains stay whole
    seen: set[BlockHash] = set()
    for ev in events:  # a parent is stored before its children
        assert ev.parent_hash in seen or ev.parent_hash not in links
        seen.update(ev.hashes)


def test_registration_events_carry_the_depth_of_their_first_block() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.register(blocks[0], H(0), BlockHash(7), depth=1)
    pool.register(blocks[1], H(1), H(0), depth=2)
    pool.register(blocks[2], H(5), H(4), depth=6)
    assert pool.drain_events() == [
        BlockStored((H(0), H(1)), 0, BlockHash(7), 1),
        BlockStored((H(5),), 0, H(4), 6),
    ]


def test_a_run_registers_as_its_blocks_one_by_one_would() -> None:
    """`register_run` against `register` block by block on a twin pool: the same matches, radix
    links, events and answer, a held hash included (that block alone stays unregistered)."""
    one, run = make_pool(8), make_pool(8)
    for pool in (one, run):
        held = pool.allocate(1) or []
        pool.register(held[0], H(2), H(1), depth=3)  # H(2) lives in another block already
    blocks_one, blocks_run = one.allocate(4) or [], run.allocate(4) or []
    assert blocks_one == blocks_run
    hashes = [H(0), H(1), H(2), H(3)]
    answers = []
    parent, depth = BlockHash(7), 1
    for block, h in zip(blocks_one, hashes, strict=True):
        answers.append(one.register(block, h, parent, depth=depth))
        parent, depth = h, depth + 1
    assert run.register_run(blocks_run, hashes, BlockHash(7), depth=1) is all(answers) is False
    chain = [*blocks_run[:2], held[0], blocks_run[3]]  # the held block stands in for H(2)
    assert run.match_prefix(hashes) == one.match_prefix(hashes) == chain
    assert run.block_hash(blocks_run[2]) is None and run.block_hash(blocks_run[3]) == H(3)
    assert run.drain_events() == one.drain_events()
    for pool in (one, run):
        pool.check_invariants()
    fresh = make_pool(4)
    blocks = fresh.allocate(2) or []
    assert fresh.register_run(blocks, [H(0), H(1)], BlockHash(7))  # depth unknown: 0 for all
    assert fresh.drain_events() == [BlockStored((H(0), H(1)), 0, BlockHash(7), 0)]
    with pytest.raises(ValueError, match="2 blocks for 1 hashes"):
        fresh.register_run(blocks, [H(0)], BlockHash(7))
