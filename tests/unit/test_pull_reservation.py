"""A pull's reservation on a real pool: what `commit` pins, and what goes back."""

from __future__ import annotations

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv import pull_reservation
from kvmesh.workers.kv.block_pool import BlockPool

ROOT = BlockHash(1)
CHAIN = [BlockHash(100 + i) for i in range(6)]


def pool_holding(num_held: int) -> BlockPool:
    """A pool of 16 blocks whose first `num_held` chain blocks were computed and freed."""
    pool = BlockPool(16)
    blocks = pool.allocate(num_held) or []
    parent = ROOT
    for depth, (b, h) in enumerate(zip(blocks, CHAIN, strict=False), start=1):
        pool.register(b, h, parent, depth=depth)
        parent = h
    pool.free(blocks)
    return pool


def test_the_reservations_references_become_the_requests_pin() -> None:
    pool = pool_holding(2)
    r = pull_reservation.reserve(pool, CHAIN, 6, ROOT, headroom=0)
    assert r is not None and len(r.local) == 2 and len(r.targets) == 4
    pinned, num_pulled = pull_reservation.commit(pool, r, 3, CHAIN)  # one block did not arrive
    assert pinned == [*r.local, *r.targets[:3]] and num_pulled == 3
    assert [pool.ref_count(b) for b in pinned] == [1] * 5  # one reference each: the request's
    assert pool.ref_count(r.targets[3]) == 0 and pool.block_hash(r.targets[3]) is None
    assert pool.match_prefix(CHAIN) == pinned
    pool.check_invariants()
    pool.free(pinned)  # the scheduler's admission lets go of the pin
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_a_block_someone_else_registered_meanwhile_is_pinned_where_it_lives() -> None:
    pool = pool_holding(0)
    r = pull_reservation.reserve(pool, CHAIN, 4, ROOT, headroom=0)
    assert r is not None and len(r.targets) == 4
    # The worker computed the chain's second block itself while the pull ran.
    (own,) = pool.allocate(1) or []
    pool.register(own, CHAIN[1], CHAIN[0], depth=2)
    pinned, num_pulled = pull_reservation.commit(pool, r, 4, CHAIN[:4])
    assert pinned == [r.targets[0], own, r.targets[2], r.targets[3]]
    assert num_pulled == 3  # the second pulled block lost to the worker's own
    assert all(pool.ref_count(b) >= 1 for b in pinned)
    pool.free([own])
    pool.free(pinned)
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks
