"""One replica's side of the ordered decision log: commit its own decisions, apply everyone's.

    route(commit=True)  -> policy.propose on the state after `cursor.applied_seq`
                        -> [speculative: send the request to the proposed worker now]
                        -> log.commit(expected=applied_seq, policy.placement_of(...))
                             committed  -> apply it (and, forced, wait for the entries before it)
                             lost       -> apply the missed entries, propose again
                                           [speculative: same worker -> keep what was sent;
                                            another -> abort it there, send it on: a redirect]
                             log away   -> place it here only, counted as unlogged
    stream entries      -> observe (any replica's, in any order: the cursor applies each once)
    trimmed / start     -> skip_to

Speculative dispatch takes the commit's round trip off the request's path: the request travels
to its worker while the commit does, and only a lost commit whose new decision picks another
worker costs the request anything (the trip, then the abort and the second send). The log still
records final placements only, in log order: a redirected request is committed under its new id
(`redirected_id`), on its new worker, after the entries it lost to.

The protocol, the cursor and the log's result type are `routing/decision_log.py`; the live log
is `index/decision_stream.py`, the simulator's `sim/decision_log.py`; an entry is a
`proto/placements.py` `Placement`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.decision_log import CommitResult, DecisionLog, LogCursor
from kvmesh.coordinator.routing.peer_routes import PeerRoutes
from kvmesh.coordinator.routing.policy import (
    RouteDecision,
    RouteQuery,
    RoutingPolicy,
    WorkerColumns,
)
from kvmesh.coordinator.telemetry.request_counters import RequestCounters
from kvmesh.coordinator.telemetry.request_record import RequestObserver
from kvmesh.proto.placements import Placement
from kvmesh.proto.request_notes import RequestTaken

Send = Callable[[RouteDecision, str], None]
"""Speculative dispatch: sends the request, under the given id, to the decision's worker, after
aborting wherever it sent it before (the coordinator's `SpeculativeSend`)."""


_MOVE_WINDOW = 64
"""Decisions `DecisionReplica.move_rate` averages over (an exponential average)."""


def redirected_id(request_id: str, num_redirects: int) -> str:
    """The id a request runs under after its `num_redirects`-th redirect: a new one, so that
    the aborted copy's notes (its worker's) never end the redirected one in a peer's load."""
    return f"{request_id}.r{num_redirects}"


class DecisionReplica:
    """Commits this replica's routing decisions to the decision log and applies the log's
    entries to the policy (and, for the other replicas' entries, to `PeerRoutes`).

    Shares the coordinator's lock, which guards the policy, the load tracker and the counters;
    every method takes it itself.

    Invariants: `cursor.applied_seq` never goes back; an entry is placed on the policy once,
    in log order (the cursor's), whichever way it came first (a lost commit or the stream).
    """

    def __init__(
        self,
        log: DecisionLog | None,
        policy: RoutingPolicy,
        peer_routes: PeerRoutes,
        registry: WorkerRegistry,
        counters: RequestCounters,
        lock: threading.Lock,
        *,
        origin: str,
        max_commit_retries: int,
        clock: Callable[[], float],
        observers: Sequence[RequestObserver] = (),
        max_move_rate: float = 1.0,
    ) -> None:
        self.log = log
        """Where this replica commits (None: it decides alone, as without a log)."""
        self.cursor = LogCursor()
        """How far this replica has applied the decision log."""
        self.policy = policy
        self.peer_routes = peer_routes
        self.registry = registry
        self.counters = counters
        self.origin = origin
        self.max_commit_retries = max_commit_retries
        self.max_move_rate = max_move_rate
        """Speculative dispatch pauses while `move_rate` exceeds this."""
        self.move_rate = 0.0
        """Recent share of this replica's decisions that a lost commit moved to another worker
        (a redirect, or what would have been one), averaged over about `_MOVE_WINDOW`
        decisions."""
        self._lock = lock
        self._clock = clock
        self.observers = tuple(observers)

    @property
    def commits(self) -> bool:
        """Decisions that will run go through the log (the policy can propose without
        choosing)."""
        return self.log is not None and self.policy.replicable

    def route(
        self,
        query: RouteQuery,
        columns: Callable[[], WorkerColumns],
        send: Send | None = None,
    ) -> RouteDecision:
        """Decide on the state after the log entries applied here, commit by compare-and-set;
        a lost commit applies the entries it missed and decides again (`decision_log.py`).
        `columns`: the fleet as the router sees it, read under the lock on every attempt.
        `send`: speculative dispatch (the request goes out before each commit; a new decision
        for another worker redirects it), unless paused (`speculates`); the decision returned
        is the one last sent."""
        log = self.log
        assert log is not None
        if not self.speculates:
            send = None
        attempt = num_redirects = 0
        sent: RouteDecision | None = None
        first: WorkerId | None = None
        placed = query
        while True:
            with self._lock:
                started = self._clock()
                decision = self.policy.propose(query, columns())
                expected = self.cursor.applied_seq
                elapsed = self._clock() - started
            for observer in self.observers:
                observer.on_routed(elapsed)
            first = decision.worker_id if first is None else first
            if send is not None:
                if sent is None or decision.worker_id != sent.worker_id:
                    if sent is not None:
                        num_redirects += 1
                        placed = replace(
                            query, request_id=redirected_id(query.request_id, num_redirects)
                        )
                    send(decision, placed.request_id)
                    sent = decision
                decision = sent  # the request runs as it was sent; the log records that
            placement = self.policy.placement_of(
                placed, decision, decision.indexed_blocks, self.origin
            )
            forced = attempt >= self.max_commit_retries
            sent_at = self._clock()
            result = log.commit(None if forced else expected, placement)
            with self._lock:
                self.counters.commit_s += self._clock() - sent_at
                self.counters.num_commit_attempts += 1
                if result is None or result.committed:
                    self._committed(result, placement, forced)
                    self.counters.num_speculative_sends += send is not None
                    self.counters.num_redirects += num_redirects
                    moved = decision.worker_id != first
                    self.move_rate += (moved - self.move_rate) / _MOVE_WINDOW
                    return decision
                self._apply(result.missed, result.seq)
            attempt += 1

    @property
    def speculates(self) -> bool:
        """Speculative dispatch is worth it now: few recent decisions were moved by a lost
        commit. Where decisions collide often (bursts of arrivals routed by several replicas
        at once), a redirect reaches its worker after the burst's other requests, which costs
        more than the commit's trip saves (`docs/reliability.md`), so it pauses there."""
        return self.move_rate <= self.max_move_rate

    def _committed(self, result: CommitResult | None, placement: Placement, forced: bool) -> None:
        """Under the lock: this replica's decision is in the log (None: the log is away, so it
        is applied here only)."""
        if result is None:
            self.counters.num_unlogged += 1
            self.policy.place(placement, self._clock())
            return
        self.counters.num_commits += 1
        self.counters.num_forced_commits += forced
        # Committed against the seq applied here, so every earlier entry is applied, unless
        # forced (then the entries between arrive through the log's stream, in order).
        self._apply(((result.seq, placement),), None)

    def observe(self, entries: Sequence[tuple[int, Placement]]) -> None:
        """Entries of the decision log as its stream delivers them (any replica's)."""
        with self._lock:
            self._apply(entries, None)

    def skip_to(self, seq: int) -> None:
        """The log's entries up to `seq` are not to be had (a start, a trimmed log)."""
        with self._lock:
            for placement in self.cursor.skip_to(seq):
                self._apply_placement(placement)

    def _apply(self, entries: Sequence[tuple[int, Placement]], log_seq: int | None) -> None:
        """Under the lock: apply entries in log order, each once. `log_seq`: where the log
        ends; entries before it that it no longer holds are stepped over."""
        if log_seq is not None and log_seq < self.cursor.applied_seq:
            self.cursor.skip_to(log_seq)  # the log went back (Redis lost it)
        for placement in self.cursor.offer(entries):
            self._apply_placement(placement)
        if log_seq is not None and self.cursor.applied_seq < log_seq:
            first_missed = min((s for s, _ in entries), default=log_seq + 1)
            if first_missed > self.cursor.applied_seq + 1:  # trimmed from the log
                for placement in self.cursor.skip_to(first_missed - 1):
                    self._apply_placement(placement)

    def _apply_placement(self, placement: Placement) -> None:
        """One log entry, as if this replica had decided it (its own: the policy only; the
        load tracker counted it when it was routed)."""
        now = self._clock()
        self.policy.place(placement, now)
        if placement.origin == self.origin or not self.registry.is_known(placement.worker_id):
            return
        taken = RequestTaken(
            placement.request_id, placement.origin, placement.prompt_len, placement.uncached_len
        )
        rid = placement.request_id
        worker = WorkerId(placement.worker_id)
        self.peer_routes.take(worker, taken, placement.predicted_prefill_ms, now)
        if self.peer_routes.has_ended(rid):  # its end was heard before its decision
            self.policy.on_request_done(rid)
