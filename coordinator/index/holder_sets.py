"""The mirror's interned holder sets: which workers hold a block, on which tier, as bitmasks.

Every worker known to the mirror has a bit. Blocks held by the same workers on the same tiers
share one interned set (an any-tier mask and a device-tier mask; id 0 is nobody), so a block
costs a set id, and a chain's match is a walk over the few positions where its set changes:

    chain     b0  b1  b2  b3  b4  b5  b6  b7
    set id     7   7   7   9   9   4   0   0        runs start at 0, 3, 5, 6
    any(set)  {A,B,C}   {A,C}   {A}  {}             A holds 6 leading blocks, C 5, B 3
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from kvmesh.coordinator.index.hash_table import NOBODY

_U64 = (1 << 64) - 1

# Byte value -> its 8 bits as the 8 bytes (0 or 1) of a uint64, bit i in byte i: a table read
# unpacks a mask's bytes, and sums of these read as 8 per-bit counts (below 256) at once.
_BYTE_BITS = np.array(
    [int.from_bytes(bytes((v >> i) & 1 for i in range(8)), "little") for v in range(256)],
    dtype=np.uint64,
)


class HolderSets:
    """Interned (any-tier mask, device-tier mask) pairs with reference counts.

    `any[s]`, `device[s]`: set s's masks (Python ints: any number of workers); `refs[s]`: the
    blocks whose set is s (the mirror counts them in and out through `ref` / `unref`). A set
    whose last block leaves is released and its id reused. `_any_low` holds each set's any-tier
    mask in a uint64 array, exactly while every mask fits 64 bits (the caller says when:
    `walk_low` is only for fleets of bits below 64).

    Invariants (checked by `check_invariants`; the mirror checks refs against its blocks):
      * an interned set has refs > 0; a released one is not interned
      * device(s) is a subset of any(s); num_tiered == interned sets with device != any
      * _any_low[s] == any(s) mod 2**64 for every set id
    """

    def __init__(self) -> None:
        self.any: list[int] = [0]
        self.device: list[int] = [0]
        self.refs: list[int] = [0]
        self._id_of: dict[tuple[int, int], int] = {(0, 0): NOBODY}
        self._free_ids: list[int] = []
        self._any_low = np.zeros(64, dtype="<u8")  # little-endian: `walk_low` reads its bytes
        # Interned sets holding some of their blocks off the device tier (a host tier in use):
        # while there are none, a chain's device match is its match.
        self.num_tiered = 0

    def __len__(self) -> int:
        """Set ids in use or free (the next new id)."""
        return len(self.any)

    def intern(self, any_mask: int, device_mask: int) -> int:
        key = (any_mask, device_mask)
        s = self._id_of.get(key)
        if s is None:
            if self._free_ids:
                s = self._free_ids.pop()
                self.any[s], self.device[s], self.refs[s] = any_mask, device_mask, 0
            else:
                s = len(self.any)
                self.any.append(any_mask)
                self.device.append(device_mask)
                self.refs.append(0)
                if s >= len(self._any_low):
                    self._any_low = np.concatenate((self._any_low, np.zeros_like(self._any_low)))
            self._any_low[s] = any_mask & _U64
            self._id_of[key] = s
            self.num_tiered += device_mask != any_mask
        return s

    def ref(self, s: int, num_blocks: int = 1) -> None:
        self.refs[s] += num_blocks

    def unref(self, s: int, num_blocks: int = 1) -> None:
        """Take `num_blocks` blocks out of set s, releasing it when none is left."""
        refs = self.refs
        refs[s] -= num_blocks
        if not refs[s]:
            del self._id_of[(self.any[s], self.device[s])]
            self.num_tiered -= self.device[s] != self.any[s]
            self._free_ids.append(s)

    def is_interned(self, s: int) -> bool:
        return self._id_of.get((self.any[s], self.device[s])) == s

    def walk(
        self, starts: list[int], run_sets: list[int], length: int
    ) -> tuple[dict[int, int], dict[int, int]]:
        """Per worker bit, the leading blocks it holds (any tier, then device) of a chain of
        `length` blocks whose holder sets change at `starts` (to `run_sets`). Where every run
        walked holds its blocks on the device tier (no host tier in use), both are one dict."""
        set_any = self.any
        active = set_any[run_sets[0]]
        num_blocks: dict[int, int] = {}
        i = 0
        masks = map(set_any.__getitem__, run_sets)
        for i, mask in zip(starts, masks, strict=True):  # noqa: B007 - i is read after the loop
            held = active & mask
            if held != active:
                gone = active ^ held
                if gone & (gone - 1):
                    _record(gone, i, num_blocks)
                else:  # one worker's run ends (most do): `_record`, inline
                    num_blocks[gone] = i
                active = held
                if not active:
                    break
        else:
            i = length
        _record(active, i, num_blocks)
        if not self.num_tiered:
            return num_blocks, num_blocks
        # the runs walked: up to the one where the last prefix ended, or all
        num_walked = bisect_left(starts, i) + 1 if not active else len(run_sets)
        set_device = self.device
        for s in run_sets[:num_walked]:
            if set_device[s] != set_any[s]:
                return num_blocks, self._walk_device(starts, run_sets, length)
        return num_blocks, num_blocks

    def _walk_device(self, starts: list[int], run_sets: list[int], length: int) -> dict[int, int]:
        """`walk`'s device tier: per worker bit, the leading run it holds on the device."""
        set_any, set_device = self.any, self.device
        active = on_device = set_any[run_sets[0]]
        num_device: dict[int, int] = {}
        i = 0
        for i, s in zip(starts, run_sets, strict=True):  # noqa: B007 - i is read after the loop
            active &= set_any[s]
            held_dev = on_device & set_device[s]
            if held_dev != on_device:
                _record(on_device ^ held_dev, i, num_device)
                on_device = held_dev
            if not active:
                break
        else:
            i = length
        _record(on_device, i, num_device)
        return num_device

    def walk_low(self, starts: np.ndarray, run_sets: np.ndarray, length: int) -> np.ndarray:
        """`walk` (any tier) in array operations, for sets whose masks all fit 64 bits: the
        leading blocks held by the worker of each bit position 0..63, then a 0 at position 64
        (`worker_bits.NO_POSITION`, the rows of no bit). `starts`: the runs' first positions
        (starts[0] == 0), `run_sets` their sets.

        The masks ANDed over the runs (a worker still holding at each run) only lose bits, so
        a bit set in the first k of them belongs to a worker whose prefix ends where run k
        starts (the chain's length after the last run)."""
        active = np.bitwise_and.accumulate(self._any_low.take(run_sets))
        num_starts = len(starts)
        ends = np.empty(num_starts + 2, dtype=np.int64)  # run k's start, the length, then 0
        ends[:num_starts] = starts
        ends[num_starts], ends[num_starts + 1] = length, 0
        # (a bit never set counts 0 runs: ends[0] == 0; position 64 reads the trailing 0)
        num_runs = np.empty(65, dtype=np.int64)
        num_runs[64] = num_starts + 1
        if num_starts < 256:
            # Byte p of every mask unpacked (`_BYTE_BITS`) into a uint64 of 8 one-bit bytes, one
            # row per p, and each row summed: a byte's sum stays below 256, so no carry crosses
            # into its neighbour, and the 8 sums' bytes are the counts of bits 0..63, in order
            # (contiguous reduces over the runs, not 64 strided byte sums into int64).
            unpacked = _BYTE_BITS.take(active.view(np.uint8).reshape(-1, 8).T)
            num_runs[:64] = np.add.reduce(unpacked, axis=1).view(np.uint8)
        else:
            bits = np.unpackbits(active.view(np.uint8), bitorder="little").reshape(-1, 64)
            np.add.reduce(bits, axis=0, dtype=np.int64, out=num_runs[:64])
        return ends.take(num_runs)

    def check_invariants(self) -> None:
        for s, refs in enumerate(self.refs):
            if s == NOBODY:
                continue
            live = self.is_interned(s)
            assert live == (refs > 0), f"set {s} interned with {refs} refs"
            assert self.device[s] & ~self.any[s] == 0, f"set {s}: device not in any"
            assert int(self._any_low[s]) == self.any[s] & _U64, f"set {s}: low mask drifted"
        tiered = sum(self.device[s] != self.any[s] for s in self._id_of.values())
        assert self.num_tiered == tiered, "tiered set count drifted"


def _record(mask: int, length: int, out: dict[int, int]) -> None:
    if not mask & (mask - 1):  # one worker (or none): most runs end one worker at a time
        if mask:
            out[mask] = length
        return
    while mask:
        low = mask & -mask
        out[low] = length
        mask ^= low
