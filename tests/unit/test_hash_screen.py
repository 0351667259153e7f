"""The hash screen: a slot's count follows the hashes added and removed, repeats included."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.coordinator.routing.hash_screen import HashScreen


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_a_hash_never_added_or_removed_is_ruled_out() -> None:
    s = HashScreen(num_slots=1024)
    assert s.may_hold(u64(1, 2, 3)).tolist() == [0, 0, 0]
    s.add(u64(1, 2))
    assert s.may_hold(u64(1, 2, 3)).tolist() == [1, 1, 0]
    s.remove(u64(1, 2))
    assert s.may_hold(u64(1, 2, 3)).tolist() == [0, 0, 0]
    s.check_invariants([])


def test_repeats_and_a_slot_shared_count_until_each_is_removed() -> None:
    s = HashScreen(num_slots=8)
    high = 2**64 - 8  # slot 0, as 8 is: the low bits of the full 64-bit hash
    s.add(u64(8, 8, high))  # a hash twice in one run, and another in its slot
    s.add(u64(8, 5))
    s.check_invariants([8, 8, high, 8, 5])
    assert s.may_hold(u64(0, 8, high, 5, 6)).tolist() == [4, 4, 4, 1, 0]
    s.remove(u64(8, 8, high))
    s.check_invariants([8, 5])
    assert s.may_hold(u64(high, 5)).tolist() == [1, 1]  # another hash's slot: not ruled out
    s.remove(u64(8, 5))
    assert not s.may_hold(u64(8, high, 5)).any()
    s.check_invariants([])


def test_counts_follow_random_adds_and_removes() -> None:
    rng = random.Random(0)
    s = HashScreen(num_slots=64)
    runs: list[list[int]] = []
    for _ in range(300):
        if runs and rng.random() < 0.4:
            s.remove(u64(*runs.pop(rng.randrange(len(runs)))))
        else:
            # runs counted one slot at a time, and past 48 hashes in one array operation
            run = [rng.getrandbits(64) for _ in range(rng.choice((1, 2, 19, 47, 48, 49, 120)))]
            run += run[: rng.randrange(3)]  # repeats
            runs.append(run)
            s.add(u64(*run))
        held = [h for run in runs for h in run]
        s.check_invariants(held)
        probe = [*held[:10], *(rng.getrandbits(64) for _ in range(10))]
        counts = s.may_hold(u64(*probe)).tolist()
        assert all(c > 0 for c in counts[: min(10, len(held))])  # never rules out a held hash


def test_the_number_of_slots_is_a_power_of_two() -> None:
    for bad in (0, 3, 100):
        with pytest.raises(ValueError, match="power of two"):
            HashScreen(num_slots=bad)
    assert HashScreen(num_slots=1).may_hold(u64(7)).tolist() == [0]
