from __future__ import annotations

from kvmesh.coordinator.index.mirror import ApplyResult, IndexMirror, PrefixMatch, WorkerId
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockRemoved, BlockStored, EventBatch

W0, W1 = WorkerId("w0"), WorkerId("w1")
H = [BlockHash(100 + i) for i in range(10)]


def batch(worker: str, seq: int, *events, gen: int = 1) -> EventBatch:  # type: ignore[no-untyped-def]
    return EventBatch(worker, gen, seq, tuple(events))


def loaded_mirror() -> IndexMirror:
    m = IndexMirror()
    m.load_worker(W0, 1, 0, [])
    m.load_worker(W1, 1, 0, [])
    return m


def test_match_counts_leading_blocks_per_worker() -> None:
    m = loaded_mirror()
    assert m.apply(batch("w0", 1, BlockStored(tuple(H[:4])))) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 1, BlockStored(tuple(H[:2]) + (H[3],)))) is ApplyResult.APPLIED
    assert m.match(H[:5]) == {W0: PrefixMatch(4, 4), W1: PrefixMatch(2, 2)}
    assert m.match([H[5]]) == {}
    m.check_invariants()


def test_host_tier_is_counted_apart() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored((H[0],)), BlockStored((H[1], H[2]), TIER_HOST)))
    assert m.match(H[:3]) == {W0: PrefixMatch(3, 1)}


def test_gap_and_new_generation_ask_for_resync_and_stale_is_ignored() -> None:
    m = loaded_mirror()
    assert m.apply(batch("w0", 1, BlockStored((H[0],)))) is ApplyResult.APPLIED
    assert m.apply(batch("w0", 1, BlockStored((H[1],)))) is ApplyResult.DUPLICATE
    assert m.apply(batch("w0", 3, BlockStored((H[2],)))) is ApplyResult.NEEDS_RESYNC
    assert m.apply(batch("w0", 1, BlockStored((H[3],)), gen=2)) is ApplyResult.NEEDS_RESYNC
    assert m.apply(batch("w0", 2, BlockStored((H[4],)), gen=0)) is ApplyResult.STALE
    assert m.apply(batch("w9", 1, BlockStored((H[4],)))) is ApplyResult.NEEDS_RESYNC
    assert m.worker_hashes(W0) == {H[0]: 0}
    m.check_invariants()


def test_remove_and_clear_and_purge_leave_no_trace() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(H[:3]))))
    m.apply(batch("w1", 1, BlockStored(tuple(H[:3]))))
    m.apply(batch("w0", 2, BlockRemoved((H[2],))))
    assert m.match(H[:3]) == {W0: PrefixMatch(2, 2), W1: PrefixMatch(3, 3)}
    m.apply(batch("w1", 2, AllCleared()))
    assert m.match(H[:3]) == {W0: PrefixMatch(2, 2)}
    assert m.remove_worker(W0) == 2
    assert m.num_blocks == 0
    m.check_invariants()


def test_removal_from_another_tier_keeps_the_indexed_copy() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored((H[0],))))
    m.apply(batch("w0", 2, BlockRemoved((H[0],), TIER_HOST)))
    assert m.match([H[0]]) == {W0: PrefixMatch(1, 1)}


def test_load_worker_replaces_previous_state() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(H[:3]))))
    m.load_worker(W0, 2, 5, [(H[7], 0)])
    assert m.worker_hashes(W0) == {H[7]: 0}
    assert m.cursor(W0) == (2, 5)
    assert m.apply(batch("w0", 6, BlockStored((H[8],)), gen=2)) is ApplyResult.APPLIED
    m.check_invariants()


def test_removals_for_a_worker_with_nothing_indexed_are_applied_not_fatal() -> None:
    # Seen on a GPU cluster: a worker resynced from an empty snapshot, then its next batch
    # evicted blocks the snapshot never had; the mirror raised and its follower thread died.
    m = IndexMirror()
    m.load_worker(WorkerId("w1"), 1, 0, [])
    evicted = (BlockHash(5), BlockHash(6))
    assert m.apply(batch("w1", 1, BlockRemoved(evicted))) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 2, AllCleared())) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 3, BlockStored((BlockHash(7),)))) is ApplyResult.APPLIED
    assert m.match([BlockHash(7)]) == {WorkerId("w1"): PrefixMatch(1, 1)}
    m.check_invariants()
