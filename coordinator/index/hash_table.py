"""The mirror's table of blocks: block hash -> holder set id, for vectorised lookups of whole
chains (the holder sets themselves, and what they mean, are the mirror's: `mirror.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvmesh.proto.block_hash import BlockHash

NOBODY = 0  # the holder set of a block nobody holds: what an absent hash maps to
FEW_HASHES = 40  # chains up to this long are looked up one hash at a time (`lookup_few`)
_MIN_DELTA = 4096
_GOLDEN_INT = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads any key pattern over slots
_GOLDEN = np.uint64(_GOLDEN_INT)
_U64 = (1 << 64) - 1
_FILTER_SLOTS_PER_ENTRY = 8  # delta filter slots per delta entry: <= 1/8 false positives
_WINDOW_SLOTS = 8  # slots after the home slot that `find` probes at once
_WINDOW_STEPS = np.arange(1, _WINDOW_SLOTS + 1, dtype=np.uint64)
_SCALAR_PROBES = 16  # keys left after a vector round below which probing goes one by one


def _home_slots(keys: np.ndarray, bits: int) -> np.ndarray:
    """Each key's first slot in a table of 2**bits (the top bits of key * golden ratio)."""
    return (keys * _GOLDEN) >> np.uint64(64 - bits)


class HashTable:
    """Block hash -> holder set id (uint32; NOBODY where absent), in about 12 bytes per block:

        keys   uint64[n]  block hashes, sorted (merges insert with one pass)
        values uint32[n]  holder set of each, current (NOBODY: no holder left)
        _index int32[2^k >= 4n]  open addressing (linear probing) from a hash to its row, so a
               chain's lookups are a few vectorised probes each, whatever n is (at most a
               quarter of the slots used: ~9/10 of the keys sit in their home slot, and a
               chain's lookup leaves fewer keys to the window stage of `find` than at half)
        delta  {hash: set id}  blocks that are not in the arrays, added since the last merge
               (id NOBODY: no holder left); merged in, and the index rebuilt, when it outgrows
               1/8 of them
        _delta_filter  bool[2^j >= 8 x the delta's bound]  set at (hash mod 2^j) for every hash
               that may have entered the delta since the last merge: of a long run of hashes
               missing from the arrays, a lookup asks the delta only for those it lets through

    A writer finds a hash's row first (`find`) and writes a hash that has one in `values`, one
    that has none in `delta`, after `note_changing` (the mirror's inner loops: no call per
    block). So a hash found in the arrays is never in the delta, and a lookup asks the delta
    only for the hashes the arrays miss. Right after a `merge` (empty delta), `values` may be
    replaced by another array of the same length.

    Invariants (checked by `check_invariants`):
      * every hash in the delta passes the delta filter, and none is in the arrays
      * keys are sorted and unique; values has their length
      * the index finds every key's row
    """

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.uint64)
        self.values = np.zeros(0, dtype=np.uint32)
        self.delta: dict[BlockHash, int] = {}
        self._delta_filter = np.zeros(_MIN_DELTA * _FILTER_SLOTS_PER_ENTRY, dtype=bool)
        self._delta_filter_mask = np.uint64(len(self._delta_filter) - 1)
        self._index = np.full(16, -1, dtype=np.int32)
        self._index_bits = 4

    def lookup(self, hashes: Sequence[BlockHash], wanted: np.ndarray | None = None) -> np.ndarray:
        """The current holder set of each hash (0: nobody), as an int64 array. `wanted`: the
        same hashes as a uint64 array, when the caller has it (`block_hash_array`)."""
        if len(hashes) <= FEW_HASHES:
            return np.array(self.lookup_few(hashes), dtype=np.int64)
        if wanted is None:
            wanted = np.fromiter(hashes, np.uint64, len(hashes))
        if not len(self.keys):
            sets = np.zeros(len(wanted), dtype=np.int64)
            missing = np.arange(len(wanted))
        else:
            rows = self.find(wanted)
            sets = self.values[rows].astype(np.int64)
            missing = (rows < 0).nonzero()[0]
            sets[missing] = NOBODY
        delta = self.delta
        if delta and len(missing):
            if len(missing) > FEW_HASHES:  # many: only those the filter lets through
                passed = self._delta_filter[wanted[missing] & self._delta_filter_mask]
                missing = missing[passed]
            # The maps run in C: a chain just stored (hundreds in the delta) costs little.
            candidates = map(hashes.__getitem__, missing.tolist())
            in_delta = np.fromiter(map(delta.get, candidates, repeat(-1)), np.int64, len(missing))
            hit = in_delta >= 0
            sets[missing[hit]] = in_delta[hit]
        return sets

    def lookup_few(self, hashes: Sequence[BlockHash], leading: bool = False) -> list[int]:
        """`lookup` one hash at a time, in Python ints: for a short chain, cheaper than the
        fixed cost of the vector rounds (the same slots probed in the same order; a hash in
        the delta, which the arrays do not have, is not probed at all). `leading`: stop after
        the first hash nobody holds (the list is shorter then): a prefix match reads no
        further, since no worker's leading run of the chain goes past it."""
        in_delta = self.delta.get
        if not len(self.keys):
            sets = [in_delta(h, NOBODY) for h in hashes]
            return sets[: sets.index(NOBODY) + 1] if leading and NOBODY in sets else sets
        row_at, key_at, set_of_row = self._index.item, self.keys.item, self.values.item
        bits = self._index_bits
        shift, mask = 64 - bits, (1 << bits) - 1
        sets = []
        for h in hashes:
            s = in_delta(h)
            if s is None:
                slot = (h * _GOLDEN_INT & _U64) >> shift  # `_home_slots`, in Python ints
                while (row := row_at(slot)) >= 0 and key_at(row) != h:
                    slot = (slot + 1) & mask
                s = set_of_row(row) if row >= 0 else NOBODY
            sets.append(s)
            if leading and s == NOBODY:
                break
        return sets

    def merged_values(self, wanted: np.ndarray) -> np.ndarray:
        """The holder set of each wanted hash in the arrays (NOBODY for one they do not have:
        the delta is not read), as int64."""
        if not len(self.keys):
            return np.zeros(len(wanted), dtype=np.int64)
        rows = self.find(wanted)
        sets = self.values[rows].astype(np.int64)
        sets[rows < 0] = NOBODY
        return sets

    def note_changing(self, wanted: np.ndarray) -> None:
        """Let the delta filter through for `wanted`, which may be about to enter the delta."""
        self._delta_filter[wanted & self._delta_filter_mask] = True

    def find(self, wanted: np.ndarray) -> np.ndarray:
        """Row of each wanted hash in the arrays, -1 where absent. Three stages, each for the
        keys the last one left (linear probing: a present key sits in the run of occupied slots
        that starts at its home slot; at the load kept, ~9/10 of the keys sit in their home slot):

            home slot, all keys at once      -> found, or absent (an empty slot), or on
            the next _WINDOW_SLOTS at once   -> found, or absent (an empty slot among them), or on
            slot by slot                     (vector rounds while many are left, then one by one)

        A row of -1 (an empty slot) reads the last key, which cannot be the wanted one there:
        a present key never has an empty slot on its way from its home slot; in a window, a hit
        after an empty slot can only be the last key, found before that slot."""
        index, keys, bits = self._index, self.keys, self._index_bits
        if not len(keys):
            return np.full(len(wanted), -1, dtype=np.int64)
        mask = np.uint64((1 << bits) - 1)
        slots = _home_slots(wanted, bits)
        rows = index[slots]
        found = np.where(keys[rows] == wanted, rows, -1).astype(np.int64)
        todo = (rows > found).nonzero()[0]  # an occupied home slot that holds another key
        if not len(todo):
            return found
        slots = slots[todo]
        window = index[(slots[:, None] + _WINDOW_STEPS) & mask]
        # Keys are unique: at most one slot of a window holds the wanted key (-1: none does).
        in_window = np.maximum.reduce(
            np.where(keys[window] == wanted[todo][:, None], window, -1), axis=1
        )
        found[todo] = in_window
        on = (in_window < 0) & (np.minimum.reduce(window, axis=1) >= 0)
        if np.count_nonzero(on):
            todo, slots = todo[on], (slots[on] + np.uint64(_WINDOW_SLOTS + 1)) & mask
            self._probe_on(wanted, found, todo, slots)
        return found

    def _probe_on(
        self, wanted: np.ndarray, found: np.ndarray, todo: np.ndarray, slots: np.ndarray
    ) -> None:
        """`find`'s last stage: probe on from `slots` for keys `todo`, one slot per vector
        round while many are left, then one by one (a round's fixed cost is more than a few
        scalar probes)."""
        index, keys = self._index, self.keys
        mask = np.uint64((1 << self._index_bits) - 1)
        while len(todo) > _SCALAR_PROBES:
            rows = index[slots].astype(np.int64)
            hit = (rows >= 0) & (keys[rows] == wanted[todo])
            found[todo[hit]] = rows[hit]
            again = (rows >= 0) & ~hit
            todo, slots = todo[again], (slots[again] + np.uint64(1)) & mask
        for i, slot in zip(todo.tolist(), slots.tolist(), strict=True):
            want = wanted[i]
            while (row := int(index[slot])) >= 0:
                if keys[row] == want:
                    found[i] = row
                    break
                slot = (slot + 1) & int(mask)

    def _build_index(self) -> None:
        """Place every row in a table of at least four times as many slots (linear probing): all
        rows at once per round; of the rows landing on one free slot one wins, the rest move
        on one slot."""
        n = len(self.keys)
        bits = max(4, (4 * n).bit_length())
        index = np.full(1 << bits, -1, dtype=np.int32)
        mask = np.uint64((1 << bits) - 1)
        rows = np.arange(n, dtype=np.int32)
        slots = _home_slots(self.keys, bits)
        while len(rows):
            free = index[slots] < 0
            index[slots[free]] = rows[free]  # of several rows on one slot, one is kept
            placed = free & (index[slots] == rows)
            rows, slots = rows[~placed], (slots[~placed] + np.uint64(1)) & mask
        self._index, self._index_bits = index, bits

    def maybe_merge(self) -> None:
        if len(self.delta) > self._max_delta():
            self.merge()

    def merge(self) -> None:
        """Fold the delta into the sorted arrays, dropping blocks nobody holds any more."""
        delta = self.delta
        if not delta:
            return
        n = len(delta)
        new_keys = np.fromiter(delta.keys(), np.uint64, n)
        new_sets = np.fromiter(delta.values(), np.uint32, n)
        order = np.argsort(new_keys)
        new_keys, new_sets = new_keys[order], new_sets[order]
        keys, sets = self.keys, self.values
        rows = np.searchsorted(keys, new_keys)
        found = rows < len(keys)
        found[found] = keys[rows[found]] == new_keys[found]
        sets[rows[found]] = new_sets[found]
        fresh = ~found & (new_sets != NOBODY)
        keys = np.insert(keys, rows[fresh], new_keys[fresh])
        sets = np.insert(sets, rows[fresh], new_sets[fresh])
        num_held = int(np.count_nonzero(sets))  # blocks somebody holds
        if len(keys) > 2 * num_held + _MIN_DELTA:  # many blocks left: compact
            kept = sets != NOBODY
            keys, sets = keys[kept], sets[kept]
        self.keys, self.values = keys, sets
        delta.clear()
        self._build_index()
        self._reset_delta_filter()

    def _reset_delta_filter(self) -> None:
        """An empty filter sized for the most the delta may hold before the next merge."""
        size = 1 << (_FILTER_SLOTS_PER_ENTRY * self._max_delta() - 1).bit_length()
        if size == len(self._delta_filter):
            self._delta_filter.fill(False)
        else:
            self._delta_filter = np.zeros(size, dtype=bool)
            self._delta_filter_mask = np.uint64(size - 1)

    def _max_delta(self) -> int:
        return max(_MIN_DELTA, len(self.keys) >> 3)

    def check_invariants(self) -> None:
        """Merges the delta first (after checking the filter lets it through)."""
        if self.delta:
            in_delta = np.fromiter(self.delta, np.uint64, len(self.delta))
            assert self._delta_filter[in_delta & self._delta_filter_mask].all(), "filter misses"
            assert (self.find(in_delta) < 0).all(), "a hash in the arrays is in the delta"
        self.merge()
        assert len(self.values) == len(self.keys), "keys and values differ in length"
        assert np.all(self.keys[1:] > self.keys[:-1]), "keys are not sorted and unique"
        rows = self.find(self.keys)
        assert np.array_equal(rows, np.arange(len(rows))), "the index misses a key's row"
