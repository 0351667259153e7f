"""Requests the other coordinator replicas routed, as their notes tell of them.

A replica knows at once what it routed itself; what the others routed it learns from request
notes (`proto/request_notes.py`): the routing coordinator's, a stream trip after the route, and
the worker's, after the step that took, prefilled or finished the request. Each note of a peer's
request is replayed into this replica's load tracker as if it had routed the request:

    taken      -> queued prefill (priced here), one more request on the worker
    prefilled  -> its prefill leaves the queue
    finished   -> it leaves the worker

so every replica's queue term (and the running count its decode step is priced from) sees the
whole fleet's in-flight work, not its own 1/K share. Only the load tracker: replaying peers'
requests into the kvmesh policy's recent placements and running context as well brings replicas
closer to one coordinator when notes arrive at once, but with a realistic trip (1 ms) it makes
replicas that route the same burst share one view and choose alike, which cost more p90 TTFT
than it saved (docs/reliability.md).
The replica's own requests come back in the notes too; `origin` tells them apart.
A request is noted taken twice, by the coordinator that routed it (at once) and by its worker
(a step later); the second is ignored, and so is a routing note that comes after the request's
end (the last `max_entries` ended ids are remembered). A peer request whose end is never heard
of (a lost note, a replica started mid-request) is let go after `ttl_s`; all of them are when
the follower rebuilds from Redis, which skips the notes written meanwhile (`clear`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_tracker import LoadTracker
from kvmesh.proto.request_notes import NoteBatch, RequestFinished, RequestPrefilled, RequestTaken


@dataclass(frozen=True, slots=True)
class _Seen:
    worker: WorkerId
    seen_s: float


class PeerRoutes:
    """Invariants: every id kept was taken by a peer's note and not yet finished or expired,
    and is pending in the load tracker; ids are kept in the order they were seen (so expiry
    reads the front); len <= max_entries; no id is both kept and ended."""

    def __init__(
        self,
        origin: str,
        load: LoadTracker,
        ttl_s: float = 600.0,
        max_entries: int = 100_000,
        on_let_go: Callable[[str], None] | None = None,
    ) -> None:
        """`on_let_go`: told of every peer request let go (the policy drops what it placed of
        it, when the decision log replays peers' decisions into the policy)."""
        if not origin:
            raise ValueError("a replica needs a non-empty origin id")
        if not ttl_s > 0 or max_entries < 1:
            raise ValueError(f"need ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.origin = origin
        self.load = load
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.on_let_go = on_let_go
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.num_taken = 0
        """Peer requests replayed so far."""

    def __len__(self) -> int:
        return len(self._seen)

    def apply(self, batch: NoteBatch, cost_model: CostModel, now_s: float) -> None:
        """Replay one worker's notes; `cost_model` prices a peer request's prefill."""
        worker = WorkerId(batch.worker_id)
        for note in batch.notes:
            if isinstance(note, RequestTaken):
                self._taken(worker, note, cost_model, now_s)
            elif note.request_id not in self._seen:
                continue  # ours, or a peer's we never saw taken
            elif isinstance(note, RequestPrefilled):
                self.load.on_prefilled(note.request_id)
            else:
                assert isinstance(note, RequestFinished)
                self._let_go(note.request_id)
        self.expire(now_s)

    def _taken(
        self, worker: WorkerId, note: RequestTaken, cost_model: CostModel, now_s: float
    ) -> None:
        cached = note.prompt_len - note.uncached_len
        self.take(worker, note, cost_model.prefill_ms(note.uncached_len, cached), now_s)

    def take(self, worker: WorkerId, note: RequestTaken, prefill_ms: float, now_s: float) -> None:
        """A peer's request, its prefill priced by the caller (the decision log carries the
        deciding replica's prediction, a pull's transfer included)."""
        rid = note.request_id
        if note.origin == self.origin or rid in self._seen or rid in self._ended:
            return  # ours (counted when routed), noted twice, or noted after its end
        if self.load.is_pending(rid):
            return  # an id this replica routed too (ids come from clients): count it once
        self.load.on_routed(rid, worker, prefill_ms, note.uncached_len)
        self._seen[rid] = _Seen(worker, now_s)
        self.num_taken += 1
        if len(self._seen) > self.max_entries:
            self._let_go(next(iter(self._seen)))

    def has_ended(self, request_id: str) -> bool:
        """A peer request whose end was heard of (among the last `max_entries` ended)."""
        return request_id in self._ended

    def _let_go(self, request_id: str) -> None:
        del self._seen[request_id]
        self._ended[request_id] = None
        if len(self._ended) > self.max_entries:
            self._ended.popitem(last=False)
        self.load.on_finished(request_id)
        if self.on_let_go is not None:
            self.on_let_go(request_id)

    def expire(self, now_s: float) -> None:
        while self._seen:
            rid, seen = next(iter(self._seen.items()))
            if now_s - seen.seen_s < self.ttl_s:
                return
            self._let_go(rid)

    def clear(self) -> None:
        """Let go of every peer request (their notes were skipped: this replica can no longer
        tell which ended; the workers' load reports stand in until new notes come)."""
        while self._seen:
            self._let_go(next(iter(self._seen)))

    def forget_worker(self, worker: WorkerId) -> None:
        """A worker left (its load tracker drops its requests itself)."""
        for rid in [r for r, s in self._seen.items() if s.worker == worker]:
            del self._seen[rid]

    def check_invariants(self) -> None:
        assert len(self._seen) <= self.max_entries
        times = [s.seen_s for s in self._seen.values()]
        assert times == sorted(times), "ids are not in the order they were seen"
        for rid in self._seen:
            assert self.load.is_pending(rid), rid
            assert rid not in self._ended, rid
        assert len(self._ended) <= self.max_entries
