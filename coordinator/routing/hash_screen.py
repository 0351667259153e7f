"""A screen that rules block hashes out of a set in one array operation.

`RoutedPrefixes` looks up the block right after each distinct match of the fleet (~35 of them
at 64 workers) and finds ~2 routed. Each lookup is a Python step; the screen answers for all of
them at once from the hashes' low bits, so only the few it cannot rule out are looked up:

    hash h ──► slot h & (num_slots - 1) ──► count == 0: h was never added (or was removed)
                                            count  > 0: h may be held (or another hash of its slot)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

# A run up to this long is counted in Python, one slot at a time (~0.1 us a hash); past it, in
# one `np.add.at` (~3 us, then ~0.06 us a hash).
_FEW_HASHES = 48


class HashScreen:
    """Counts of the hashes held, by slot (a hash's low bits).

    Invariants (checked by `check_invariants`):
      * counts[s] == number of hashes added and not removed whose slot is s, a hash counted as
        often as it was added (a multiset: `remove` takes back exactly what `add` put)
      * so a hash whose slot counts 0 is not held; a count > 0 may be another hash's

    `num_slots` is a power of two: a slot is then one `&`, and the array (4 bytes a slot) is
    zeroed by the allocator lazily, page by page, as slots are first written. The counts are
    one array, read by numpy and written through a memoryview of it from Python.
    """

    def __init__(self, num_slots: int = 1 << 18) -> None:
        if num_slots < 1 or num_slots & (num_slots - 1):
            raise ValueError(f"num_slots must be a power of two, got {num_slots}")
        self.num_slots = num_slots
        # (a 0-d array: an operand numpy takes as it is, ~0.2 us less than a scalar's conversion)
        self._mask = np.array(num_slots - 1, dtype=np.uint64)
        self._counts = np.zeros(num_slots, dtype=np.int32)
        self._slot_counts = self._counts.data  # the same memory, for Python's steps

    def add(self, hashes: np.ndarray) -> None:
        """Count `hashes` (uint64) once more each, repeats included."""
        if len(hashes) <= _FEW_HASHES:
            counts, mask = self._slot_counts, self.num_slots - 1
            for h in hashes.tolist():
                counts[h & mask] += 1
        else:
            np.add.at(self._counts, (hashes & self._mask).view(np.int64), 1)

    def remove(self, hashes: np.ndarray) -> None:
        """Take back one `add` of `hashes`."""
        if len(hashes) <= _FEW_HASHES:
            counts, mask = self._slot_counts, self.num_slots - 1
            for h in hashes.tolist():
                counts[h & mask] -= 1
        else:
            np.subtract.at(self._counts, (hashes & self._mask).view(np.int64), 1)

    def may_hold(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash of `hashes` (uint64), its slot's count: 0 where the hash is not held."""
        return self._counts.take((hashes & self._mask).view(np.int64))

    def check_invariants(self, held: Iterable[int]) -> None:
        """`held`: every hash added and not removed, as often as it was added."""
        expected = np.zeros(self.num_slots, dtype=np.int64)
        for slot, count in Counter(h & (self.num_slots - 1) for h in held).items():
            expected[slot] = count
        assert (self._counts >= 0).all(), "a slot counts below zero"
        assert np.array_equal(self._counts, expected), "slot counts drifted from the hashes held"
