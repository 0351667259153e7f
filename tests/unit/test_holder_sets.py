from __future__ import annotations

import random

import numpy as np

from kvmesh.coordinator.index.holder_sets import HolderSets
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.worker_bits import NO_POSITION, WorkerBits


def _chain_of_runs(rng: random.Random, sets: HolderSets, length: int) -> list[int]:
    """The holder set of each block of a chain: runs of random sets of the 64 bits, each run's
    set a random subset of the one before (a prefix that holders leave) or, now and then, any
    set (a worker holding blocks past a hole in its run)."""
    mask = (1 << 64) - 1
    chain, s = [], sets.intern(mask, mask)
    while len(chain) < length:
        chain += [s] * rng.randrange(1, 30)
        mask = mask & rng.getrandbits(64) if rng.random() < 0.8 else rng.getrandbits(64)
        s = sets.intern(mask, mask)
    return chain[:length]


def test_walk_low_counts_what_the_python_walk_counts() -> None:
    """`walk_low` gives every bit position the leading blocks `walk` gives its bit, and 0 at
    `NO_POSITION`, on chains of random runs, holes included."""
    rng = random.Random(11)
    sets = HolderSets()
    for _ in range(200):
        length = rng.randrange(1, 400)
        chain = _chain_of_runs(rng, sets, length)
        starts = [i for i in range(length) if not i or chain[i] != chain[i - 1]]
        run_sets = [chain[i] for i in starts]
        by_bit, _ = sets.walk(starts, run_sets, length)
        low = sets.walk_low(np.array(starts), np.array(run_sets), length)
        assert len(low) == NO_POSITION + 1 and low[NO_POSITION] == 0
        assert low[:NO_POSITION].tolist() == [by_bit.get(1 << p, 0) for p in range(64)]
    for s in range(1, len(sets)):
        sets.ref(s)
    sets.check_invariants()


def test_walk_low_counts_chains_of_hundreds_of_runs_as_the_python_walk() -> None:
    """Up to 255 runs, the bits' counts are summed in bytes of 64-bit lanes; from 256 on, in
    int64: both give what `walk` gives, on either side of the switch."""
    rng = random.Random(12)
    sets = HolderSets()
    mask = (1 << 64) - 1
    for num_runs in (254, 255, 256, 257, 600):
        chain: list[int] = []
        for k in range(num_runs):
            # a worker leaves every fourth run; the others alternate two sets (holes too)
            held = mask >> (k // 4) if k % 2 else (mask >> (k // 4)) ^ rng.getrandbits(3)
            chain += [sets.intern(held, held)] * rng.randrange(1, 3)
        starts = [i for i in range(len(chain)) if not i or chain[i] != chain[i - 1]]
        run_sets = [chain[i] for i in starts]
        by_bit, _ = sets.walk(starts, run_sets, len(chain))
        low = sets.walk_low(np.array(starts), np.array(run_sets), len(chain))
        assert low[:NO_POSITION].tolist() == [by_bit.get(1 << p, 0) for p in range(64)]
        assert low[NO_POSITION] == 0


def test_a_released_set_is_reused_and_its_low_mask_rewritten() -> None:
    sets = HolderSets()
    a = sets.intern(0b101, 0b001)
    sets.ref(a, 3)
    assert sets.num_tiered == 1
    sets.unref(a, 3)  # its last blocks left: released
    assert sets.num_tiered == 0 and not sets.is_interned(a)
    b = sets.intern(0b10, 0b10)
    assert b == a and sets.any[b] == 0b10
    sets.ref(b)
    sets.check_invariants()  # the low mask follows the set now in the id


def test_worker_bits_give_the_lowest_free_bit_and_a_fleet_its_positions() -> None:
    bits = WorkerBits()
    w = [WorkerId(f"w{i}") for i in range(4)]
    assert [bits.bit(x) for x in w[:3]] == [1, 2, 4]
    assert bits.release(w[1]) == 2 and bits.bit(w[3]) == 2  # the freed bit goes first
    row_of = {w[3]: 0, w[0]: 1, WorkerId("new"): 2}
    fleet = bits.fleet(row_of, 3)
    assert fleet.row_of_bit == {1: 1, 2: 0}
    assert fleet.positions is not None and fleet.positions.tolist() == [1, 0, NO_POSITION]
    assert bits.fleet(row_of, 3) is fleet  # kept while the same fleet comes
    bits.bit(w[1])
    assert bits.fleet(row_of, 3) is not fleet  # a bit given: made again
    bits.check_invariants()
