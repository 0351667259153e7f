"""The index's prefix tree: links from stored events, hits, tree order, link checks, and the
mirror keeping it to exactly the blocks it indexes."""

from __future__ import annotations

import pytest

from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import IndexMirror, WorkerId
from kvmesh.coordinator.index.radix_tree import RadixTree
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockRemoved, BlockStored, EventBatch

ROOT = BlockHash(7)
A, B, C, D, E = (BlockHash(100 + i) for i in range(5))
W0, W1 = WorkerId("w0"), WorkerId("w1")


def tree_of(*chains: tuple[tuple[BlockHash, ...], BlockHash, int]) -> RadixTree:
    t = RadixTree()
    for hashes, parent, depth in chains:
        t.link(hashes, parent, depth)
    return t


def test_link_records_a_chain_one_level_per_block() -> None:
    t = tree_of(((A, B, C), ROOT, 1))
    assert [(t.parent(h), t.depth(h)) for h in (A, B, C)] == [(ROOT, 1), (A, 2), (B, 3)]
    assert t.num_nodes == 3


def test_unknown_parent_links_nothing_and_unknown_depth_stays_unknown() -> None:
    t = tree_of(((A, B), BlockHash(0), 1), ((C, D), ROOT, 0))
    assert A not in t and B not in t
    assert (t.parent(D), t.depth(C), t.depth(D)) == (C, 0, 0)


def test_nodes_come_in_tree_order_parent_first() -> None:
    t = tree_of(((A, B, C), ROOT, 1), ((D,), A, 2), ((E,), BlockHash(9), 1))
    order = [n.block_hash for n in t.nodes()]
    assert order.index(A) < order.index(B) < order.index(C)
    assert order.index(A) < order.index(D)
    assert sorted(order) == [A, B, C, D, E]
    assert len(t.nodes(limit=2)) == 2


def test_top_ranks_by_hits_then_depth_and_unlink_forgets_hits() -> None:
    t = tree_of(((A, B, C), ROOT, 1))
    for h in (B, B, C, C, A):
        t.note_hit(h)
    t.note_hit(E)  # not linked: ignored
    assert [(n.block_hash, n.num_hits) for n in t.top(3)] == [(C, 2), (B, 2), (A, 1)]
    t.unlink(C)
    assert [n.block_hash for n in t.top(3)] == [B, A]
    t.check_invariants({A, B})
    with pytest.raises(ValueError):
        t.top(-1)


def test_check_links_finds_orphans_and_bad_depths() -> None:
    t = tree_of(((A, B, C), ROOT, 1))
    assert t.check_links().ok
    t.unlink(B)  # C's parent is gone: no prompt reaches C any more
    check = t.check_links()
    assert (check.num_orphans, check.orphans) == (1, (C,))
    t2 = tree_of(((A,), ROOT, 1), ((D,), A, 5))
    check2 = t2.check_links()
    assert (check2.num_bad_depths, check2.bad_depths, check2.ok) == (1, (D,), False)


def batch(worker: str, seq: int, *events: object) -> EventBatch:
    return EventBatch(worker, 1, seq, tuple(events))  # type: ignore[arg-type]


def mirror() -> IndexMirror:
    m = IndexMirror()
    m.load_worker(W0, 1, 0, [])
    m.load_worker(W1, 1, 0, [])
    return m


def test_mirror_links_stored_blocks_and_unlinks_the_last_holder() -> None:
    m = mirror()
    m.apply(batch("w0", 1, BlockStored((A, B, C), parent_hash=ROOT, depth=1)))
    m.apply(batch("w1", 1, BlockStored((A, B), parent_hash=ROOT, depth=1)))
    m.apply(batch("w0", 2, BlockRemoved((B, C))))
    assert C not in m.tree and m.tree.parent(B) == A  # w1 still holds B
    m.remove_worker(W1)
    assert m.tree.num_nodes == 1 and A in m.tree
    m.check_invariants()


def test_a_demotion_and_a_full_republish_keep_their_links() -> None:
    m = mirror()
    m.apply(batch("w0", 1, BlockStored((A, B), parent_hash=ROOT, depth=1)))
    # Evicted to the host tier in one step: removed from the device, stored on the host
    # (host events name no parent).
    m.apply(batch("w0", 2, BlockRemoved((B,)), BlockStored((B,), TIER_HOST)))
    assert (m.tree.parent(B), m.tree.depth(B)) == (A, 2)
    m.apply(batch("w0", 3, AllCleared(), BlockStored((A, B), parent_hash=ROOT, depth=1)))
    assert m.tree.num_nodes == 2
    m.load_worker(W0, 1, 3, [(A, 0), (B, 0)])  # a resync keeps what is still held
    assert m.tree.parent(B) == A
    m.load_worker(W0, 1, 4, [(A, 0)])
    assert B not in m.tree
    m.check_invariants()


def test_locked_mirror_counts_a_hit_on_the_deepest_match() -> None:
    locked = LockedMirror(mirror())
    locked.apply(batch("w0", 1, BlockStored((A, B, C), parent_hash=ROOT, depth=1)))
    locked.apply(batch("w1", 1, BlockStored((A,), parent_hash=ROOT, depth=1)))
    locked.match([A, B, D])
    locked.match([A, B, C])
    locked.match([E])
    views, total = locked.tree_nodes(10, hottest=True)
    assert total == 3
    assert [(v.node.block_hash, v.node.num_hits) for v in views] == [(C, 1), (B, 1)]
    first, _ = locked.tree_nodes(1)
    assert first[0].node.block_hash == A and first[0].holders == {W0: 0, W1: 0}


def test_a_link_read_without_depth_never_replaces_one_with_depth() -> None:
    locked = LockedMirror(mirror())
    locked.apply(batch("w0", 1, BlockStored((A, B), parent_hash=ROOT, depth=1)))
    locked.apply(batch("w1", 1, BlockStored((C,), TIER_HOST)))
    locked.link([(B, A, 0), (C, B, 0), (D, C, 3)])  # D is not indexed: no link
    views, total = locked.tree_nodes(10)
    assert total == 3
    assert {(v.node.block_hash, v.node.parent_hash, v.node.depth) for v in views} == {
        (A, ROOT, 1),
        (B, A, 2),
        (C, B, 0),
    }
