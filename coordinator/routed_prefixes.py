"""Prefixes the router has just sent somewhere, before the index can know about them.

The index mirror learns that a worker holds a prefix only when the worker has prefilled it and
its KV events arrive. Until then, a burst of requests sharing a new prefix would all look
uncached everywhere and be spread over the cluster, each worker recomputing the same prefix.
The router therefore remembers, for a short time, which worker it sent each prompt's block chain
to, and treats that worker as about to hold it:

    routed now ──────────────► prefilled (events reach the mirror) ──► done / expired: forgotten
               remembered here                                    (the mirror knows by then)

Entries leave when the request is reported done, or after `ttl_s` at the latest, so the memory
stays bounded even if completions are never reported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.coordinator.index_mirror import WorkerId
from kvmesh.proto.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class _Routed:
    worker: WorkerId
    hashes: tuple[BlockHash, ...]
    expires_s: float


class RoutedPrefixes:
    """Block chains routed to each worker and not yet confirmed, with reference counts.

    Invariants (checked by `check_invariants`):
      * hash_to_worker_refs[h][w] == number of live entries routed to w whose chain contains h
      * no empty inner dict is kept
      * entries are ordered by expiry (insertion order with one TTL)
    """

    def __init__(self, ttl_s: float = 30.0, max_entries: int = 100_000) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Routed] = OrderedDict()
        self._hash_to_worker_refs: dict[BlockHash, dict[WorkerId, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self, request_id: str, worker: WorkerId, hashes: Sequence[BlockHash], now_s: float
    ) -> None:
        self.discard(request_id)
        entry = _Routed(worker, tuple(hashes), now_s + self.ttl_s)
        self._entries[request_id] = entry
        refs = self._hash_to_worker_refs
        for h in entry.hashes:
            holders = refs.get(h)
            if holders is None:
                refs[h] = {worker: 1}
            else:
                holders[worker] = holders.get(worker, 0) + 1
        if len(self._entries) > self.max_entries:
            self._drop(self._entries.popitem(last=False)[1])

    def discard(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._drop(entry)

    def expire(self, now_s: float) -> None:
        while self._entries:
            request_id, entry = next(iter(self._entries.items()))
            if entry.expires_s > now_s:
                return
            del self._entries[request_id]
            self._drop(entry)

    def forget_worker(self, worker: WorkerId) -> None:
        for request_id in [r for r, e in self._entries.items() if e.worker == worker]:
            self.discard(request_id)

    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, int]:
        """Per worker, the leading blocks of `hashes` routed to it (workers with none omitted)."""
        refs = self._hash_to_worker_refs
        out: dict[WorkerId, int] = {}
        active: set[WorkerId] | None = None
        for i, h in enumerate(hashes, 1):
            holders = refs.get(h)
            if holders is None:
                break
            active = set(holders) if active is None else active.intersection(holders)
            if not active:
                break
            for w in active:
                out[w] = i
        return out

    def _drop(self, entry: _Routed) -> None:
        refs = self._hash_to_worker_refs
        for h in entry.hashes:
            holders = refs[h]
            left = holders[entry.worker] - 1
            if left:
                holders[entry.worker] = left
            else:
                del holders[entry.worker]
                if not holders:
                    del refs[h]

    def check_invariants(self) -> None:
        expected: dict[BlockHash, dict[WorkerId, int]] = {}
        for entry in self._entries.values():
            for h in entry.hashes:
                holders = expected.setdefault(h, {})
                holders[entry.worker] = holders.get(entry.worker, 0) + 1
        assert expected == self._hash_to_worker_refs, "reference counts drifted from entries"
        expiries = [e.expires_s for e in self._entries.values()]
        assert expiries == sorted(expiries), "entries are not in expiry order"
