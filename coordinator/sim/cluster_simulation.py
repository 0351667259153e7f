"""One simulation run: the real coordinator over simulated workers, on simulated time.

    arrival: Coordinator.generate (registry, mirror.match, views, policy.choose, load
             tracker, pull plan) -> WorkerRequest -> SimBackend -> SimWorker queue
    worker events (SimWorker): admission, prefill end, completions -> pool KV events ->
    EventBatch -> mirror; first / last token fed back through the coordinator's stream

Nothing here is a model of the router: the simulation drives the real `Coordinator`, with the
same policy objects, load tracker and pull planning the live system runs, reading a mirror fed
by the `BlockPool`s' own KV events, so what it believes is exactly what the live system would
believe (minus network delay). Only the workers' compute is replaced, by `SimCostModel`.

The `oracle` is a bound, not a policy: one shared pool of N x C blocks served by N compute lanes
(each request goes to the lane with the least queued work), in which a prefix is reusable from the
moment any lane starts computing it: what the cluster could reuse if placement never cost a hit.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import ApplyResult, WorkerId
from kvmesh.coordinator.prompt_preparer import PreparedPrompt
from kvmesh.coordinator.routing.load_tracker import LoadTracker, ReportedLoad
from kvmesh.coordinator.routing.policy import RoutingPolicy
from kvmesh.coordinator.routing.router import POLICIES
from kvmesh.coordinator.sim.backend import SimBackend
from kvmesh.coordinator.sim.decision_log import SimDecisionLog
from kvmesh.coordinator.sim.delivery import StreamDelivery
from kvmesh.coordinator.sim.fleet_pools import FleetPools
from kvmesh.coordinator.sim.pulls import SimPulls
from kvmesh.coordinator.sim.report import PolicyResult, summarize
from kvmesh.coordinator.sim.report_clock import ReportClock
from kvmesh.coordinator.sim.shared_pool_index import SharedPoolIndex
from kvmesh.coordinator.sim.unread_tokens import UnreadTokens
from kvmesh.coordinator.sim.worker import PullSource, SimRequest, SimSequence, SimWorker
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.proto.block_hash import namespace_hash
from kvmesh.proto.events import EventBatch
from kvmesh.proto.request_notes import NoteBatch
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.kv.block_pool import BlockPool
from kvmesh.workers.model.model_config import preset

if TYPE_CHECKING:  # simulator.py runs this class; here its config is only read
    from kvmesh.coordinator.sim.simulator import SimConfig

ORACLE = "oracle"
SIM_MODEL = "kvmesh-simulator"
"""The model the simulated fleet serves: the namespace its prompts are hashed under."""
# The coordinator checks prompts against a model's context; simulated prompts have no limit.
_SIM_MODEL_CONFIG = dataclasses.replace(preset("tiny-random"), max_position_embeddings=1 << 30)


class ClusterSimulation:
    """One policy (or the oracle) over one prepared workload; `run` once.

    The real `Coordinator` routes every request (registry, mirror, load tracker, policy, pull
    planning) and streams its outputs; only the workers behind it are simulated."""

    def __init__(
        self,
        config: SimConfig,
        policy_name: str,
        requests: Sequence[SimRequest],
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """`timer` times the routing decisions: this thread's CPU time by default, so that
        `decisions_per_s` is per second of CPU, as reported, whatever else the machine runs."""
        if policy_name != ORACLE and policy_name not in POLICIES:
            raise ValueError(f"unknown policy {policy_name!r}")
        self.config = config
        self.policy_name = policy_name
        self.requests = requests
        self._timer = timer
        self.now_ms = 0.0
        n = config.num_workers
        self.oracle = policy_name == ORACLE
        self.workers = self._build_workers()
        # The workload and the simulated workers' pools (their per-block lists: ~1.5M entries
        # at 256 workers) are the simulator's, not the coordinator's: frozen out of the garbage
        # collector's walks until `run` ends, so a full collection that a timed decision sets
        # off walks what a live coordinator holds (mirror, policy, load), not what its workers
        # do. The coordinator's objects, made below, are walked as they would be live.
        gc.freeze()
        self.worker_ids = [WorkerId(w.worker_id) for w in self.workers]
        self.mirror = LockedMirror()
        for wid in self.worker_ids:
            self.mirror.load_worker(wid, 1, 0, [])
        self._event_seq = [0] * n
        self.backend = SimBackend(self.workers)
        self._fleet_pools = FleetPools(self.worker_ids, [w.pool for w in self.workers])
        self.decision_log = (
            SimDecisionLog(self._clock_ms, config.note_delay_ms, config.num_coordinators)
            if config.decision_log
            else None
        )
        self._commit_ms = [0.0] * len(requests)
        """Per request: the decision log's round trips before it reached its worker."""
        self._dispatches: list[tuple[float, int, int, SimRequest, PullSource | None, str]] = []
        """Requests on their way to their worker (heap by arrival there)."""
        self.coordinators = [self._build_coordinator(k) for k in range(config.num_coordinators)]
        self.coordinator = self.coordinators[0]
        self._reports = ReportClock(config.report_interval_ms, config.reports_on_clock)
        self._notes_in_flight: deque[tuple[float, NoteBatch]] = deque()
        for coordinator in self.coordinators:
            coordinator.note_sink = self._post_notes
        self._streams: dict[int, Iterator[StreamEvent]] = {}
        """Each workload request's coordinator stream, by `SimRequest.index` (a redirected
        request reaches its worker under another id)."""
        self.delivery = StreamDelivery(config.cost, config.num_coordinators)
        self._heap: list[tuple[float, int, int, int]] = []
        self._scheduled_epoch = [-1] * n
        self._order = 0
        self._decision_s = 0.0
        self._cached = [0] * len(requests)
        self._pulled = [0] * len(requests)
        self._ttft = [math.nan] * len(requests)
        self._e2e = [math.nan] * len(requests)
        self._tpot = [math.nan] * len(requests)
        self._worker_of = [-1] * len(requests)
        self._last_finish_ms = 0.0

    @property
    def policy(self) -> RoutingPolicy:
        return self.coordinator.policy

    @property
    def load(self) -> LoadTracker:
        return self.coordinator.load

    def _build_workers(self) -> list[SimWorker]:
        config = self.config
        n, c = config.num_workers, config.num_blocks
        shared = BlockPool(n * c) if self.oracle else None
        root = namespace_hash(SIM_MODEL)
        return [
            SimWorker(
                f"w{i}",
                shared or BlockPool(c),
                config.cost,
                config.block_size,
                root,
                register_on_admit=shared is not None,
                sessions=None if shared is not None else config.sessions,
                host_blocks=0 if shared is not None else config.host_blocks,
            )
            for i in range(n)
        ]

    def _build_coordinator(self, k: int) -> Coordinator:
        config = self.config
        registry = WorkerRegistry()
        for wid in self.worker_ids:
            registry.add(wid)
        coordinator_config = CoordinatorConfig(
            block_size=config.block_size,
            policy="least_loaded" if self.oracle else self.policy_name,
            route_seed=config.seed + k,
            decision_log=self.decision_log is not None,
            speculative_dispatch=config.speculative_dispatch,
        )
        index = SharedPoolIndex(self.workers[0].pool, self.worker_ids) if self.oracle else None
        pools = {wid: w.pool for wid, w in zip(self.worker_ids, self.workers, strict=True)}
        return Coordinator(
            coordinator_config,
            _SIM_MODEL_CONFIG,
            self.backend,
            index or self.mirror,
            registry,
            worker_free_blocks=lambda w: (
                pools[WorkerId(w)].num_blocks,
                pools[WorkerId(w)].num_free,
            ),
            worker_free_blocks_many=self._fleet_pools,
            cost_model=config.cost.router_cost_model(),
            transfers=SimPulls(config.cost) if config.pulls and not self.oracle else None,
            clock=lambda: self.now_ms / 1000.0,
            decision_log=self.decision_log,
        )

    def _clock_ms(self) -> float:
        return self.now_ms

    def run(self) -> PolicyResult:
        try:
            return self._run()
        finally:
            gc.unfreeze()  # what the constructor froze goes back to the collector

    def _run(self) -> PolicyResult:
        start_s = time.perf_counter()
        requests, heap = self.requests, self._heap
        i = 0
        dispatches = self._dispatches
        while i < len(requests) or heap or dispatches:
            next_ms = min(
                heap[0][0] if heap else math.inf,
                requests[i].arrival_ms if i < len(requests) else math.inf,
            )
            if dispatches:
                next_ms = min(next_ms, dispatches[0][0])
            if self._reports.due_before_event(next_ms):
                self._send_reports()
            if dispatches and dispatches[0][0] <= next_ms:
                self._on_dispatch(heapq.heappop(dispatches))
            elif heap and (i == len(requests) or heap[0][0] <= requests[i].arrival_ms):
                t, _, w, epoch = heapq.heappop(heap)
                if epoch == self.workers[w].epoch:
                    self.now_ms = t
                    self._on_worker_event(w)
            else:
                self.now_ms = requests[i].arrival_ms
                self._on_arrival(requests[i])
                i += 1
        if any(math.isnan(t) for t in self._e2e):
            raise AssertionError("a request never got its last token")
        counts = np.bincount(self._worker_of, minlength=len(self.workers))
        result = summarize(
            self.policy_name,
            [r.prompt_len for r in requests],
            self._cached,
            self._pulled,
            self._ttft,
            self._tpot,
            self._e2e,
            self.config.slo,
            requests[0].arrival_ms if requests else 0.0,
            self._last_finish_ms,
            [w.busy_ms for w in self.workers],
            [int(x) for x in counts],
            self._decision_s,
            time.perf_counter() - start_s,
        )
        if self.decision_log is None or not requests:
            return result
        attempts = sum(c.counters.num_commit_attempts for c in self.coordinators)
        redirects = sum(c.counters.num_redirects for c in self.coordinators)
        return replace(
            result,
            commit_attempts_per_request=attempts / len(requests),
            commit_ms_mean=float(np.mean(self._commit_ms)),
            redirects_per_request=redirects / len(requests),
        )

    def request_times(self) -> list[tuple[float, float, float]]:
        """(TTFT, TPOT, end-to-end) in ms of every request, in workload order, after `run`
        (TPOT is NaN for a one-token answer)."""
        return list(zip(self._ttft, self._tpot, self._e2e, strict=True))

    def request_tokens(self) -> list[tuple[int, int]]:
        """(cached, pulled) prompt tokens of every request, in workload order, after `run`."""
        return list(zip(self._cached, self._pulled, strict=True))

    def _on_arrival(self, request: SimRequest) -> None:
        tokens = UnreadTokens(request.prompt_len)
        prompt = PreparedPrompt(tokens, request.prompt_hashes, "")
        sampling = SamplingConfig(max_tokens=max(1, request.output_len), ignore_eos=True)
        self.backend.expect(request)
        self._report_load()
        self._deliver_notes()
        if self.decision_log is not None:
            self.decision_log.deliver([c.decisions for c in self.coordinators])
        coordinator = self.coordinators[request.index % len(self.coordinators)]
        attempts = coordinator.counters.num_commit_attempts
        trip_ms = self.config.commit_trip_ms
        self.backend.dispatch_delay_ms = lambda: (
            (coordinator.counters.num_commit_attempts - attempts) * trip_ms
        )
        start = self._timer()
        self._streams[request.index] = coordinator.generate(
            prompt, sampling, session_id=request.session_id, request_id=request.request_id
        )
        self._decision_s += self._timer() - start
        self.backend.deliver_pending()  # the worker's queueing: not the decision's
        # What the commits held the request back by: every attempt without speculative
        # dispatch; with it, the trips before its last redirect (the copy that was not aborted).
        self._commit_ms[request.index] = max((d for d, _ in self.backend.deferred), default=0.0)
        for delay_ms, (w, sim_request, pull, origin) in self.backend.deferred:
            self._order += 1
            entry = (self.now_ms + delay_ms, self._order, w, sim_request, pull, origin)
            heapq.heappush(self._dispatches, entry)
        self.backend.deferred.clear()
        for w in self.backend.touched:
            self._admit(w)
            self._schedule(w)
            self._send_notes(w)
        self.backend.touched.clear()

    def _on_dispatch(
        self, dispatch: tuple[float, int, int, SimRequest, PullSource | None, str]
    ) -> None:
        """A request whose decision was committed reaches its worker."""
        self.now_ms, _, w, request, pull, origin = dispatch
        self.backend.deliver(w, request, pull, origin)
        self._admit(w)
        self._schedule(w)
        self._send_notes(w)
        self.backend.touched.clear()

    def _report_load(self) -> None:
        """Every report interval, each worker's own load reaches every coordinator (as the live
        health loop's WorkerInfo does), so replicas see each other's requests."""
        if self._reports.due_on_arrival(self.now_ms):
            self._send_reports()

    def _send_reports(self) -> None:
        for wid, worker in zip(self.worker_ids, self.workers, strict=True):
            report = ReportedLoad(worker.queued_prefill_tokens, worker.num_requests)
            for coordinator in self.coordinators:
                coordinator.load.on_reported(wid, report)

    def _send_notes(self, w: int) -> None:
        """The worker's request notes set off to every coordinator."""
        batch = self.workers[w].notes.drain()
        if batch is not None:
            self._post_notes(batch)

    def _post_notes(self, batch: NoteBatch) -> None:
        """Notes appended to the stream now land `note_delay_ms` later, in order."""
        self._notes_in_flight.append((self.now_ms + self.config.note_delay_ms, batch))

    def _deliver_notes(self) -> None:
        """Notes that have landed by now reach every coordinator (each skips its own)."""
        in_flight = self._notes_in_flight
        while in_flight and in_flight[0][0] <= self.now_ms:
            _, batch = in_flight.popleft()
            for coordinator in self.coordinators:
                coordinator.observe_notes(batch)

    def _on_worker_event(self, w: int) -> None:
        worker = self.workers[w]
        outcome = worker.advance(self.now_ms)
        self._fleet_pools.refresh(w)
        for seq in outcome.prefilled:
            request = seq.request
            self._note_admitted(w, seq)  # one batched into a step was not seen at admission
            latency = self.config.cost.service_latency_ms
            coordinator = request.index % len(self.coordinators)
            client_ms = self.delivery.open(request.index, coordinator, self.now_ms)
            self._ttft[request.index] = client_ms - request.arrival_ms + latency
            self.backend.first_token(seq)
            next(self._streams[request.index])  # the coordinator sees the first token
        for seq in outcome.finished:
            self._finish(seq)
        self._flush_events(w)
        self._send_notes(w)
        lanes = range(len(self.workers)) if self.oracle and outcome.finished else (w,)
        for lane in lanes:
            self._admit(lane)
            self._schedule(lane)

    def _finish(self, seq: SimSequence) -> None:
        request = seq.request
        latency = self.config.cost.service_latency_ms
        num_tokens = max(1, request.output_len)
        first_ms, last_ms = self.delivery.close(request.index, self.now_ms, num_tokens)
        last_ms += self.config.cost.stream_end_ms
        self._e2e[request.index] = last_ms - request.arrival_ms + latency
        if request.output_len > 1:  # one token has no time *per output token*
            decode_ms = last_ms - first_ms
            self._tpot[request.index] = decode_ms / (request.output_len - 1)
        self.backend.last_token(seq)
        for _ in self._streams.pop(seq.request.index):
            pass  # the last event, then the stream closes: load and policy let go of it
        self._last_finish_ms = max(self._last_finish_ms, self.now_ms)

    def _admit(self, w: int) -> None:
        seq = self.workers[w].try_admit(self.now_ms)
        self._fleet_pools.refresh(w)
        if seq is not None:
            self._note_admitted(w, seq)
            self._flush_events(w)

    def _note_admitted(self, w: int, seq: SimSequence) -> None:
        self._cached[seq.request.index] = seq.cached_tokens
        self._pulled[seq.request.index] = seq.pulled_tokens
        self._worker_of[seq.request.index] = w

    def _schedule(self, w: int) -> None:
        worker = self.workers[w]
        if self._scheduled_epoch[w] == worker.epoch:
            return
        t = worker.next_event_ms()
        if t < math.inf:
            self._order += 1
            heapq.heappush(self._heap, (max(t, self.now_ms), self._order, w, worker.epoch))
            self._scheduled_epoch[w] = worker.epoch

    def _flush_events(self, w: int) -> None:
        events = self.workers[w].drain_events()
        if not events or self.oracle:
            return  # the oracle's shared pool needs no index
        self._event_seq[w] += 1
        batch = EventBatch(self.worker_ids[w], 1, self._event_seq[w], tuple(events))
        result = self.mirror.apply(batch)
        assert result is ApplyResult.APPLIED, result
