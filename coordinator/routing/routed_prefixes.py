"""Prefixes the router has just sent somewhere, before the index can know about them.

The index mirror learns that a worker holds a prefix only when the worker has prefilled it and
its KV events arrive. Until then, a burst of requests sharing a new prefix would all look
uncached everywhere and be spread over the cluster, each worker recomputing the same prefix.
The router therefore remembers, for a short time, which worker it sent each prompt's block chain
to, and treats that worker as about to hold it:

    routed now ──────────────► prefilled (events reach the mirror) ──► done / expired: forgotten
               remembered here                                    (the mirror knows by then)

Only the blocks beyond what the index already shows on that worker are kept, so a follow-up
turn of a cached conversation costs a few entries, not its whole chain. The same run sent to the
same worker again while it is remembered (the burst above, once its head is routed: every one of
its requests now matches there) is counted once, with its requests, not hash by hash again.

Entries leave when the request is reported done, or after `ttl_s` at the latest, so the memory
stays bounded even if completions are never reported.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import compress, repeat
from operator import is_not

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.hash_screen import HashScreen
from kvmesh.proto.block_hash import BlockHash

_FEW_HASHES = 32  # a run sharing hashes with others, up to this long, is counted hash by hash

# A shared run's key: the hash of (its worker, its number of hashes, its last hash). An int, not
# the tuple: a key kept per routed prompt is then nothing for the garbage collector to count.
_RunKey = int


class RoutedPrefixes:
    """Runs of blocks routed to each worker and not yet confirmed, with reference counts.

    Invariants (checked by `check_invariants`):
      * hash_to_worker_refs[h][w] == number of distinct counted runs routed to w that contain h:
        an entry with a shared run (`_shared_key_of[r]` set) counts its run once with every
        other entry under the same key; an entry without one counts its run on its own
      * num_sharing[k] == number of live entries whose `_shared_key_of` is k, and
        shared_run[k] and shared_worker[k] are their run (the same hashes, one array) and worker
      * no empty inner dict is kept
      * the screen holds every counted run's hashes, as often as `hash_to_worker_refs` counts
        them (so a hash it rules out has no entry there)
      * entries are ordered by expiry (insertion order with one TTL)

    An entry is dict values (expiry, worker, the run's hashes as a uint64 array, its shared
    run's key) rather than one object: a routed prompt then leaves nothing young for the garbage
    collector to count, nor a tuple of the prompt's ints to walk, each int read from memory,
    while young. A run whose key is held by another worker or other hashes (a chain whose last
    hash does not fix the ones before it, or the keys' hashes colliding) is counted on its own.

    `screen_slots`: the size of the `HashScreen` that `extend_many` reads first (a power of two;
    at 4 bytes a slot, 1 MiB by default, of which only the slots written take memory).
    """

    def __init__(
        self, ttl_s: float = 30.0, max_entries: int = 100_000, screen_slots: int = 1 << 18
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expires_s: OrderedDict[str, float] = OrderedDict()  # in expiry order
        self._worker_of: dict[str, WorkerId] = {}
        self._run_of: dict[str, np.ndarray] = {}
        self._shared_key_of: dict[str, _RunKey | None] = {}
        self._num_sharing: dict[_RunKey, int] = {}
        self._shared_run: dict[_RunKey, np.ndarray] = {}
        self._shared_worker: dict[_RunKey, WorkerId] = {}
        # A lone worker id stands for {worker: 1}, the common case: a run's new hashes are then
        # added in one `dict.update` (C), not one Python step each (prompts run to 512 blocks).
        self._hash_to_worker_refs: dict[BlockHash, WorkerId | dict[WorkerId, int]] = {}
        self._screen = HashScreen(screen_slots)

    def __len__(self) -> int:
        return len(self._expires_s)

    def add(
        self,
        request_id: str,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        now_s: float,
        start: int = 0,
        hash_array: np.ndarray | None = None,
    ) -> None:
        """Remember that `hashes[start:]` were sent to `worker` (the index already shows it
        holding `hashes[:start]`, so only the blocks it will add are kept). `hash_array`:
        `hashes` as a uint64 array, when the caller has one (copied, not converted again)."""
        self.discard(request_id)
        hashes = hashes[start:]
        self._expires_s[request_id] = now_s + self.ttl_s
        self._worker_of[request_id] = worker
        if hash_array is None:
            run = np.fromiter(hashes, np.uint64, len(hashes))
        else:  # (a copy: a view would keep the whole prompt's array while the run is kept)
            run = hash_array[start:].copy()
        self._run_of[request_id] = run
        key: _RunKey | None = hash((worker, len(hashes), hashes[-1])) if hashes else None
        if key is not None:
            shared = self._shared_run.get(key)
            if shared is None:
                self._shared_run[key] = run
                self._shared_worker[key] = worker
                self._num_sharing[key] = 1
            elif self._shared_worker[key] == worker and shared.tobytes() == run.tobytes():
                # counted already: one more request
                self._num_sharing[key] += 1
                self._shared_key_of[request_id] = key
                self._run_of[request_id] = shared
                self._bound()
                return
            else:
                key = None
        self._shared_key_of[request_id] = key
        self._count(worker, hashes)
        self._screen.add(run)
        self._bound()

    def _bound(self) -> None:
        if len(self._expires_s) > self.max_entries:
            self.discard(next(iter(self._expires_s)))

    def _count(self, worker: WorkerId, hashes: Sequence[BlockHash]) -> None:
        """One more counted run of `hashes` routed to `worker`."""
        refs = self._hash_to_worker_refs
        if refs.keys().isdisjoint(hashes):  # a new run: all its hashes in one update
            num_before = len(refs)
            refs.update(zip(hashes, repeat(worker)))
            if len(refs) - num_before != len(hashes):  # a hash twice in one chain: count each
                for h, count in Counter(hashes).items():
                    if count > 1:
                        refs[h] = {worker: count}
        elif len(hashes) <= _FEW_HASHES:
            for h in hashes:
                self._ref(h, worker)
        else:
            run = set(hashes)
            if len(run) != len(hashes):  # a hash twice in one chain: count each
                for h in hashes:
                    self._ref(h, worker)
            else:
                shared = refs.keys() & run
                for h in shared:
                    self._ref(h, worker)
                refs.update(zip(run - shared, repeat(worker)))

    def _ref(self, h: BlockHash, worker: WorkerId) -> None:
        refs = self._hash_to_worker_refs
        holders = refs.get(h)
        if holders is None:
            refs[h] = worker
        elif isinstance(holders, str):
            refs[h] = {worker: 2} if holders == worker else {holders: 1, worker: 1}
        else:
            holders[worker] = holders.get(worker, 0) + 1

    def discard(self, request_id: str) -> None:
        if self._expires_s.pop(request_id, None) is None:
            return
        worker, run = self._worker_of.pop(request_id), self._run_of.pop(request_id)
        key = self._shared_key_of.pop(request_id)
        if key is not None:
            left = self._num_sharing[key] - 1
            if left:  # other requests still count the run
                self._num_sharing[key] = left
                return
            del self._num_sharing[key], self._shared_run[key], self._shared_worker[key]
        self._drop(worker, run)

    def expire(self, now_s: float) -> None:
        expires_s = self._expires_s
        while expires_s:
            request_id, at_s = next(iter(expires_s.items()))
            if at_s > now_s:
                return
            self.discard(request_id)

    def forget_worker(self, worker: WorkerId) -> None:
        for request_id in [r for r, w in self._worker_of.items() if w == worker]:
            self.discard(request_id)

    def extend(
        self,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        held: int,
        hash_array: np.ndarray | None = None,
    ) -> int:
        """How many leading blocks of `hashes` `worker` will hold, given that it holds the first
        `held` (the index says so) and the routed blocks that continue them.

        A routed run of blocks is contiguous, so its end is found by bisection, not by walking
        the prompt: a handful of lookups whatever the prompt's length. `hash_array`: as for
        `extend_many`.
        """
        refs = self._hash_to_worker_refs
        n = len(hashes)
        if held >= n:
            return held
        hash_at = hashes.__getitem__ if hash_array is None else hash_array.item
        if not _holds(refs.get(hash_at(held)), worker):
            return held
        return self._bisect(worker, held + 1, n, hash_at)

    def _bisect(
        self, worker: WorkerId, lo: int, n: int, hash_at: Callable[[int], BlockHash]
    ) -> int:
        """`extend`'s end of the routed run, `worker` known to hold the chain's first `lo`
        blocks (the index's and the routed block right after them)."""
        get = self._hash_to_worker_refs.get
        hi = n  # worker holds hashes[:lo]; it does not hold hashes[:hi + 1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            holders = get(hash_at(mid - 1))  # `_holds`, inline
            if holders is not None and (
                holders == worker if isinstance(holders, str) else worker in holders
            ):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def extend_many(
        self,
        index_of: Mapping[WorkerId, int],
        hashes: Sequence[BlockHash],
        held: np.ndarray,
        hash_array: np.ndarray | None = None,
    ) -> np.ndarray:
        """`extend` for a whole fleet: `held[i]` is what row i's worker holds (`index_of` maps a
        worker to its row). Only the workers routed the block right after their own match can
        grow, so the cost follows the few distinct matches and their routed holders, not the
        size of the fleet. `hash_array`: `hashes` as a uint64 array, when the caller has it:
        the hashes looked up are then made from it, not read from the prompt's int objects,
        which are cold by now (one cache miss each; a lookup reads a key of the dict only
        where it finds one), and only the rows the screen cannot rule out are looked up."""
        refs, n = self._hash_to_worker_refs, len(hashes)
        out = held
        starts: Collection[int]
        held_at: Callable[[int], int]
        if not n:
            return out
        if hash_array is not None:
            # The screen rules out, in one operation, the rows whose next block nobody was
            # routed; ~2 of a fleet's ~35 distinct matches are left to look up. (A row holding
            # the whole chain reads its last hash here, clipped, and is left out below.)
            maybe = self._screen.may_hold(hash_array.take(held, mode="clip")).nonzero()[0]
            if not len(maybe):
                return out
            held_at = held.item  # (a few rows: not the whole column as a list)
            starts = {start for row in maybe.tolist() if (start := held_at(row)) < n}
        else:
            if len(hashes) <= _FEW_HASHES and refs.keys().isdisjoint(hashes):
                return out  # nothing of this short chain was routed lately (for a long one, the
                # check would cost more than the lookups below)
            held_list = held.tolist()
            held_at = held_list.__getitem__
            # each row grows on its own: the order does not matter
            starts = set(held_list)
            if max(starts) >= n:  # only a match shorter than the chain may grow
                starts = [start for start in starts if start < n]
        # (the lookups in C maps; a hash made from the array one at a time, not by a gather of
        # a list of starts, which costs its conversion to an array)
        hash_at = hashes.__getitem__ if hash_array is None else hash_array.item
        routed = list(map(refs.get, map(hash_at, starts)))
        is_routed = map(is_not, routed, repeat(None))
        for start, holders in compress(zip(starts, routed, strict=True), is_routed):
            assert holders is not None  # (compress kept only these)
            for worker in (holders,) if isinstance(holders, str) else holders:
                row = index_of.get(worker)
                if row is None or held_at(row) != start:
                    continue
                if out is held:
                    out = held.copy()
                out[row] = self._bisect(worker, start + 1, n, hash_at)  # (`extend`)
        return out

    def _drop(self, worker: WorkerId, run: np.ndarray) -> None:
        self._screen.remove(run)
        refs = self._hash_to_worker_refs
        for h in run.tolist():
            holders = refs[h]
            if holders == worker:  # the lone-id form: the last reference goes
                del refs[h]
                continue
            assert isinstance(holders, dict), (h, holders)
            left = holders[worker] - 1
            if left:
                holders[worker] = left
            else:
                del holders[worker]
                if not holders:
                    del refs[h]

    def check_invariants(self) -> None:
        assert self._expires_s.keys() == self._worker_of.keys() == self._run_of.keys()
        assert self._run_of.keys() == self._shared_key_of.keys()
        keys = [k for k in self._shared_key_of.values() if k is not None]
        assert Counter(keys) == self._num_sharing, "shared runs' request counts drifted"
        assert self._shared_run.keys() == self._num_sharing.keys() == self._shared_worker.keys()
        counted: dict[_RunKey, str] = {}  # each shared run once, by its first request
        for request_id, key in self._shared_key_of.items():
            if key is None:
                continue
            counted.setdefault(key, request_id)
            run = self._run_of[request_id]
            assert run is self._shared_run[key], "a shared run's requests hold other hashes"
            worker = self._worker_of[request_id]
            assert worker == self._shared_worker[key], "a shared run's requests on other workers"
            assert key == hash((worker, len(run), int(run[-1]))), "a shared run under another key"
        expected: dict[BlockHash, dict[WorkerId, int]] = {}
        for request_id, worker in self._worker_of.items():
            key = self._shared_key_of[request_id]
            if key is not None and counted[key] != request_id:
                continue
            for h in self._run_of[request_id].tolist():
                holders = expected.setdefault(h, {})
                holders[worker] = holders.get(worker, 0) + 1
        held = {
            h: {v: 1} if isinstance(v, str) else v for h, v in self._hash_to_worker_refs.items()
        }
        assert expected == held, "reference counts drifted from entries"
        self._screen.check_invariants(
            h for h, holders in expected.items() for _ in range(sum(holders.values()))
        )
        assert all(v for v in held.values()), "an empty holder set is kept"
        expiries = list(self._expires_s.values())
        assert expiries == sorted(expiries), "entries are not in expiry order"


def _holds(holders: WorkerId | dict[WorkerId, int] | None, worker: WorkerId) -> bool:
    if holders is None:
        return False
    return holders == worker if isinstance(holders, str) else worker in holders
