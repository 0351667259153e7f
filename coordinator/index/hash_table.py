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
_MIN_RUN = 16
_MAX_SHORT_STEPS = 8
"""`lookup_chain` reads a chain's runs of at least `_MIN_RUN` blocks in consecutive rows from
their first hash; after `_MAX_SHORT_STEPS` shorter steps (a shorter run, or a hash in the
delta), the rest of the chain in vector rounds. (A few: a long chain that nobody holds past its
first few blocks, a new conversation on a shared system prompt, stops there. Eight, not four:
a chain that workers prefilled to different depths is long runs with short ones between them,
and a vector round over a rest of ~100 blocks costs ~20 us more than a few more steps.)"""


def _home_slots(keys: np.ndarray, bits: int) -> np.ndarray:
    """Each key's first slot in a table of 2**bits (the top bits of key * golden ratio)."""
    return (keys * _GOLDEN) >> np.uint64(64 - bits)


class HashTable:
    """Block hash -> holder set id (uint32; NOBODY where absent), in about 12 bytes per block:

        keys   uint64[n]  block hashes, unique, in the order they were stored (a merge appends
               the delta's), so a chain stored at once sits in consecutive rows
        values uint32[n]  holder set of each, current (NOBODY: no holder left)
        _index int32[2^k >= 4n]  a hash's home slot -> the row of one key it is home to (-1:
               none), so a chain's lookups are one vectorised gather each, whatever n is
        _displaced_keys uint64[m], _displaced_rows int32[m]  the keys whose home slot another
               key holds (at a quarter load or less, about 1/9 of them), sorted, and their
               rows: a chain's few are found by one binary search (`searchsorted`)
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
      * keys are unique; values has their length; the displaced keys are sorted
      * every key is in its home slot or among the displaced keys, not both
    """

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.uint64)
        self.values = np.zeros(0, dtype=np.uint32)
        self.delta: dict[BlockHash, int] = {}
        self._delta_filter = np.zeros(_MIN_DELTA * _FILTER_SLOTS_PER_ENTRY, dtype=bool)
        self._delta_filter_mask = np.uint64(len(self._delta_filter) - 1)
        self._index = np.full(16, -1, dtype=np.int32)
        self._index_bits = 4
        self._displaced_keys = np.zeros(0, dtype=np.uint64)
        self._displaced_rows = np.zeros(0, dtype=np.int32)

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
            sets = self.values.take(rows).astype(np.int64)  # (-1 reads the last: set below)
            missing = (rows < 0).nonzero()[0]
            sets[missing] = NOBODY
        delta = self.delta
        if delta and len(missing):
            # Only those the filter lets through, however few are missing: most pass none, and
            # then the prompt's hash objects (cold by now) are not read at all.
            slots = wanted.take(missing) & self._delta_filter_mask  # (below 2**63: as int64)
            missing = missing[self._delta_filter.take(slots.view(np.int64))]
            if len(missing):
                # The maps run in C: a chain just stored (hundreds in the delta) costs little.
                candidates = map(hashes.__getitem__, missing.tolist())
                in_delta = map(delta.get, candidates, repeat(-1))
                found = np.fromiter(in_delta, np.int64, len(missing))
                hit = found >= 0
                sets[missing[hit]] = found[hit]
        return sets

    def lookup_few(self, hashes: Sequence[BlockHash], leading: bool = False) -> list[int]:
        """`lookup` one hash at a time, in Python ints: for a short chain, cheaper than the
        fixed cost of the vector rounds (the same home slot, then the displaced keys; a hash
        in the delta, which the arrays do not have, is not looked for there at all).
        `leading`: stop after the first hash nobody holds (the list is shorter then): a prefix
        match reads no further, since no worker's leading run of the chain goes past it."""
        in_delta = self.delta.get
        if not len(self.keys):
            sets = [in_delta(h, NOBODY) for h in hashes]
            return sets[: sets.index(NOBODY) + 1] if leading and NOBODY in sets else sets
        row_at, key_at, set_of_row = self._index.item, self.keys.item, self.values.item
        displaced_at, displaced_key_at = (
            self._displaced_keys.searchsorted,
            self._displaced_keys.item,
        )
        displaced_row_at, num_displaced = self._displaced_rows.item, len(self._displaced_keys)
        shift = 64 - self._index_bits
        sets = []
        for h in hashes:
            s = in_delta(h)
            if s is None:
                row = row_at((h * _GOLDEN_INT & _U64) >> shift)  # `_home_slots`, in Python ints
                if row >= 0 and key_at(row) != h:
                    at = int(displaced_at(np.uint64(h)))  # (a Python int: ~9x slower)
                    found = at < num_displaced and displaced_key_at(at) == h
                    row = displaced_row_at(at) if found else -1
                s = set_of_row(row) if row >= 0 else NOBODY
            sets.append(s)
            if leading and s == NOBODY:
                break
        return sets

    def lookup_chain(
        self, hashes: Sequence[BlockHash], wanted: np.ndarray | None = None
    ) -> np.ndarray:
        """`lookup` of a chain's leading hashes, at least through the first that nobody holds
        (the array may be shorter than the chain then), as int64: what a prefix match reads.
        `wanted`: `hashes` as a uint64 array, when the caller has it (made here only if the
        chain's first hash is held).

        The arrays keep keys in the order they were stored, so a chain stored in one event
        (a prompt's prefill) sits in consecutive rows. A run is found from its first hash (its
        row, in Python ints) and read as far as the rows that follow hold the chain's next
        hashes (one contiguous compare): a few cache lines per run, where the vector lookup
        reads three scattered ones per hash. After a few short steps (runs of a chain stored a
        few blocks at a time, as decode steps store an answer's, or hashes in the delta, which
        keeps no order), the rest goes to the vector lookup.

            chain    h0 h1 h2 h3 h4 h5 h6 ...
            keys     .. h0 h1 h2 h3 .. .. h4 h5 h6 ..     two runs: rows r..r+3, r'..r'+2
        """
        num_hashes = len(hashes)
        sets = np.empty(num_hashes, dtype=np.int64)
        keys, values, delta = self.keys, self.values, self.delta
        num_keys = len(keys)
        hash_at = hashes.__getitem__ if wanted is None else wanted.item
        j = num_short = 0
        while j < num_hashes:
            if num_short == _MAX_SHORT_STEPS:  # not stored in long runs: the rest at once
                if wanted is None:
                    wanted = np.fromiter(hashes, np.uint64, num_hashes)
                sets[j:] = self.lookup(hashes[j:], wanted[j:])  # (all of it)
                return sets
            h = hash_at(j)  # (from the array: a fresh int, where the prompt's own are cold)
            s = delta.get(h) if delta else None
            if s is not None:  # stored since the last merge (so not in the arrays)
                sets[j] = s
                j += 1
                num_short += 1
                if s == NOBODY:
                    return sets[:j]
                continue
            row = self._find_one(h) if num_keys else -1
            if row < 0:
                sets[j] = NOBODY
                return sets[: j + 1]
            end = min(num_hashes, j + num_keys - row)  # the chain's end, or the arrays'
            run = end - j
            if run > 1 and keys.item(row + 1) != hash_at(j + 1):
                run = 1  # (the next row holds another chain: no array compare)
            elif run > 1:
                if wanted is None:
                    wanted = np.fromiter(hashes, np.uint64, num_hashes)
                    hash_at = wanted.item
                differs = keys[row + 2 : row + run] != wanted[j + 2 : end]
                first = int(differs.argmax()) if run > 2 else 0
                if run > 2 and differs.item(first):
                    run = first + 2
            sets[j : j + run] = values[row : row + run]
            j += run
            num_short += run < _MIN_RUN
        return sets

    def _find_one(self, h: int) -> int:
        """`find` of one hash, in Python ints."""
        row: int = self._index.item((h * _GOLDEN_INT & _U64) >> (64 - self._index_bits))
        if row >= 0 and self.keys.item(row) != h:
            displaced = self._displaced_keys
            at = int(displaced.searchsorted(np.uint64(h)))  # (as in `lookup_few`)
            found = at < len(displaced) and displaced.item(at) == h
            row = self._displaced_rows.item(at) if found else -1
        return row

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
        """Row of each wanted hash in the arrays, -1 where absent (int32). Two stages:

            home slot, all keys at once  -> found, or absent (an empty slot), or
            the displaced keys           -> found, or absent (one binary search of the ~1/9
                                            left, in a sorted array of ~1/9 of the keys)

        A row of -1 (an empty slot) reads the last key, which cannot be the wanted one there:
        a present key's home slot is never empty."""
        keys = self.keys
        if not len(keys):
            return np.full(len(wanted), -1, dtype=np.int32)
        # (the slots are below 2**60: as int64, `take` reads them without a conversion)
        found = self._index.take(_home_slots(wanted, self._index_bits).view(np.int64))
        # A home slot that holds another key, or none (-1, as it reads the last key): the
        # displaced keys have the one, not the other (then found there or not, -1 either way).
        todo = (keys.take(found) != wanted).nonzero()[0]
        if len(todo):
            displaced_keys = self._displaced_keys
            if not len(displaced_keys):
                found[todo] = -1
                return found
            left = wanted.take(todo)
            at = displaced_keys.searchsorted(left)  # (len: past the last, clipped below)
            hit = displaced_keys.take(at, mode="clip") == left
            found[todo] = np.where(hit, self._displaced_rows.take(at, mode="clip"), -1)
        return found

    def _build_index(self) -> None:
        """Give every key's home slot (in a table of at least four times as many slots) to one
        of the keys it is home to; the others are the displaced keys, sorted."""
        n = len(self.keys)
        bits = max(4, (4 * n).bit_length())
        index = np.full(1 << bits, -1, dtype=np.int32)
        rows = np.arange(n, dtype=np.int32)
        slots = _home_slots(self.keys, bits).view(np.int64)
        index[slots] = rows  # of several rows with one home slot, one is kept
        displaced = (index.take(slots) != rows).nonzero()[0]
        displaced_keys = self.keys.take(displaced)
        order = displaced_keys.argsort()
        self._index, self._index_bits = index, bits
        self._displaced_keys = displaced_keys.take(order)
        self._displaced_rows = displaced.take(order).astype(np.int32)

    def maybe_merge(self) -> None:
        if len(self.delta) > self._max_delta():
            self.merge()

    def merge(self) -> None:
        """Fold the delta into the arrays, after the keys there (in the delta's order, which is
        the order the blocks were stored in), dropping blocks nobody holds any more."""
        delta = self.delta
        if not delta:
            return
        n = len(delta)
        new_keys = np.fromiter(delta.keys(), np.uint64, n)
        new_sets = np.fromiter(delta.values(), np.uint32, n)
        # (the delta never holds a key the arrays have: the writers' contract, checked by
        # `check_invariants`)
        fresh = new_sets != NOBODY
        keys = np.concatenate((self.keys, new_keys[fresh]))
        sets = np.concatenate((self.values, new_sets[fresh]))
        num_held = int(np.count_nonzero(sets))  # blocks somebody holds
        if len(keys) > 2 * num_held + _MIN_DELTA:  # many blocks left: compact (order kept)
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
        assert len(np.unique(self.keys)) == len(self.keys), "a key is in the arrays twice"
        rows = np.arange(len(self.keys))
        at_home = self._index[_home_slots(self.keys, self._index_bits)] == rows
        displaced = np.sort(self._displaced_rows)
        assert np.array_equal(displaced, rows[~at_home]), "displaced rows drifted"
        assert np.all(self._displaced_keys[1:] > self._displaced_keys[:-1]), "displaced unsorted"
        assert np.array_equal(self._displaced_keys, self.keys[self._displaced_rows]), "drifted"
        assert np.array_equal(self.find(self.keys), rows), "the index misses a key's row"
