"""The request path, without gRPC: validate, hash, look up, route, stream from the worker.

prompts    token ids (or text) -> validated prompt + chained block hashes (prompt_preparer.py)
fleet      block hashes -> per-worker held prefix, from the in-memory mirror (fleet_view.py)
route()    prices every routable worker and picks one, maybe with a pull plan   (routing/);
           one that will run is committed to the decision log (decision_replica.py)
generate() sends the chosen worker a `WorkerRequest` (with its pull plan: the worker runs the
           pull itself) and streams its outputs through a worker's death, keeping the load
           tracker honest (request_stream.py); with
           speculative dispatch the request is sent while its commit travels, and redirected
           if the commit loses to a decision that moves it (speculative_send.py)

Pure of torch, Ray and gRPC: the worker is reached through `WorkerBackend` (`contract.py`: the
Ray shell in production, simulated workers in the simulator, a fake in tests); which workers may
be routed to is the registry's call (`cluster/registry.py`).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.contract import (
    InvalidRequest,
    NoLiveWorker,
    PrefixIndex,
    WorkerBackend,
)
from kvmesh.coordinator.decision_replica import DecisionReplica
from kvmesh.coordinator.fleet_view import FleetView, FreeBlocksMany
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.prompt_preparer import PreparedPrompt, PromptPreparer, TextCodec
from kvmesh.coordinator.request_stream import RequestStream
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.decision_log import DecisionLog
from kvmesh.coordinator.routing.load_tracker import LoadTracker, ReportedLoad
from kvmesh.coordinator.routing.peer_routes import PeerRoutes
from kvmesh.coordinator.routing.policy import RouteDecision, RouteQuery
from kvmesh.coordinator.routing.pull_planner import PullPlan, best_peer, cheapest_prefill
from kvmesh.coordinator.routing.router import make_policy
from kvmesh.coordinator.routing.transfer_planner import PullPricing
from kvmesh.coordinator.session_turns import SessionTurns, TurnMode
from kvmesh.coordinator.speculative_send import SpeculativeSend
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.coordinator.telemetry.request_counters import RequestCounters
from kvmesh.coordinator.telemetry.request_record import (
    RequestObserver,
    RequestRecord,
)
from kvmesh.proto.block_hash import num_reusable_blocks, num_reusable_tokens
from kvmesh.proto.request_notes import NoteBatch, RequestTaken
from kvmesh.workers.contract.replies import (
    RequestOutput,
    WorkerInfo,
)
from kvmesh.workers.contract.requests import PullSpec, SamplingConfig, WorkerRequest
from kvmesh.workers.model.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class _Turn:
    """One `generate` call's routing arguments, carried to where the stream starts."""

    session_id: str
    worker_id: str
    request_id: str
    allow_pull: bool
    label: str
    started: float
    count: bool
    """Count it among its session's turns in flight when the stream starts (an exclusive turn
    was counted before it was routed)."""
    max_tokens: int | None
    """The answer length the router prices decode over (None: unknown)."""


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        model: ModelConfig,
        backend: WorkerBackend,
        mirror: PrefixIndex,
        registry: WorkerRegistry,
        *,
        tokenizer: TextCodec | None = None,
        index_connected: Callable[[], bool] = lambda: True,
        worker_free_blocks: Callable[[str], tuple[int, int]] | None = None,
        worker_free_blocks_many: FreeBlocksMany | None = None,
        cost_model: CostModel | None = None,
        transfers: PullPricing | None = None,
        clock: Callable[[], float] = time.monotonic,
        observers: Sequence[RequestObserver] = (),
        kv_dtype: str = "float32",
        cache_epoch: Callable[[], int] = lambda: 0,
        decision_log: DecisionLog | None = None,
    ) -> None:
        """`decision_log`: where this replica commits its decisions (used when
        `config.decision_log` is on and the policy is `replicable`)."""
        self.config = config
        self.model = model
        self.backend = backend
        self.mirror = mirror
        self.registry = registry
        self.prompts = PromptPreparer(
            config, model, tokenizer=tokenizer, kv_dtype=kv_dtype, cache_epoch=cache_epoch
        )
        """Validates and hashes prompts: `prepare` before `route` or `generate`."""
        self.cost_model = cost_model or CostModel()
        self.policy = make_policy(
            config.policy,
            self.cost_model,
            random.Random(config.route_seed),
            clock,
            session_affinity_blocks=config.session_affinity_blocks,
        )
        self.turns = SessionTurns()
        self.load = LoadTracker()
        self.fleet = FleetView(
            mirror,
            self.load,
            index_connected=index_connected,
            worker_free_blocks=worker_free_blocks,
            worker_free_blocks_many=worker_free_blocks_many,
        )
        """The fleet as the router sees it for a prompt: `match`, and `columns` for routing."""
        self.origin = uuid.uuid4().hex[:16]
        """This replica's id in the requests it sends (`WorkerRequest.origin`)."""
        self.peer_routes = PeerRoutes(self.origin, self.load, on_let_go=self._peer_done)
        self.note_sink: Callable[[NoteBatch], None] | None = None
        """Where each routing decision goes as a `RequestTaken` note for the other replicas
        (the deployment's `NoteSender`; None: peers hear of it from the worker only)."""
        self.lock = threading.Lock()  # guards policy, load tracker and counters
        self.counters = RequestCounters()
        self.transfers = transfers
        if transfers is not None:
            self.policy.transfer_ms = transfers.price
            self.policy.transfer_ms_many = transfers.price_many
            self.policy.transfer_ms_uniform = transfers.uniform_price
        self.clock = clock
        self.observers = tuple(observers)
        """Told of every routing decision and every request's end (metrics, the request log)."""
        self.decisions = DecisionReplica(
            decision_log if config.decision_log else None,
            self.policy,
            self.peer_routes,
            registry,
            self.counters,
            self.lock,
            origin=self.origin,
            max_commit_retries=config.max_commit_retries,
            max_move_rate=config.speculation_max_move_rate,
            clock=clock,
            observers=self.observers,
        )
        """Commits this replica's decisions to the decision log and applies the log's entries
        (`decision_replica.py`)."""

    # ---- lookup and routing -------------------------------------------------------------------

    def route(
        self,
        prompt: PreparedPrompt,
        session_id: str = "",
        request_id: str = "",
        max_tokens: int | None = None,
        *,
        commit: bool = False,
        speculative: SpeculativeSend | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> RouteDecision:
        """`max_tokens`: what the request may generate, when the caller said (its decode load
        is priced over it); None routes as for an answer of unknown length. `commit`: the
        request will run (Generate), so the decision goes to the decision log when there is
        one; a decision-only call (Route) stays this replica's. `speculative`: with the log,
        the request is sent through it before each commit (else it is left unsent). `avoid`:
        workers this request saw die, which the registry may not have heard of yet."""
        live = self._routable_for(prompt.adapter)
        if avoid:
            live = tuple(w for w in live if w not in avoid)
            if not live:
                raise NoLiveWorker("no live worker can take the request")
        query = RouteQuery(
            request_id or uuid.uuid4().hex,
            prompt.block_hashes,
            len(prompt.token_ids),
            self.config.block_size,
            session_id,
            max_tokens,
            prompt.block_hash_array,
        )
        if commit and self.decisions.commits:
            return self.decisions.route(
                query,
                lambda: self.fleet.columns(prompt, live, self.cost_model),
                speculative.send if speculative is not None else None,
            )
        with self.lock:
            started = self.clock()
            decision = self.policy.choose(query, self.fleet.columns(prompt, live, self.cost_model))
            elapsed = self.clock() - started
        for observer in self.observers:
            observer.on_routed(elapsed)
        return decision

    def _peer_done(self, request_id: str) -> None:
        """A peer's request ended (PeerRoutes, under the lock)."""
        self.policy.on_request_done(request_id)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: PreparedPrompt,
        sampling: SamplingConfig,
        *,
        session_id: str = "",
        worker_id: str = "",
        request_id: str = "",
        allow_pull: bool = True,
        label: str = "",
        turn_mode: TurnMode = TurnMode.CONCURRENT,
        max_tokens_known: bool = True,
    ) -> Iterator[StreamEvent]:
        """Route (unless `worker_id` forces placement) and stream the worker's outputs.
        `allow_pull=False` with `worker_id` serves from that worker's own cache only, as a
        standalone engine would (the per-worker HTTP endpoints that peer routers front).
        `label` is the id the client sees (for the request log); default: the request id.
        With a `turn_mode` other than CONCURRENT, the stream first waits for (or refuses, with
        `SessionBusy`) another turn of the session in flight, and routes only then.
        `max_tokens_known=False`: `sampling.max_tokens` is a server default (the rest of the
        context), not the caller's, so the router treats the answer's length as unknown."""
        started = self.clock()
        self.prompts.check_sampling(prompt, sampling)
        if prompt.media:
            raise InvalidRequest(
                "the built-in runner is text-only: Generate takes no media items"
                " (Route and Lookup do, for external multimodal engines)"
            )
        max_tokens = sampling.max_tokens if max_tokens_known else None
        turn = _Turn(
            session_id, worker_id, request_id, allow_pull, label, started, True, max_tokens
        )
        if session_id and turn_mode is not TurnMode.CONCURRENT:
            return self._exclusive_turn(prompt, sampling, replace(turn, count=False), turn_mode)
        return self._route_and_stream(prompt, sampling, turn)

    def _exclusive_turn(
        self, prompt: PreparedPrompt, sampling: SamplingConfig, turn: _Turn, mode: TurnMode
    ) -> Iterator[StreamEvent]:
        self.turns.begin(turn.session_id, mode, self.config.session_queue_timeout_s)
        try:
            yield from self._route_and_stream(prompt, sampling, turn)
        finally:
            self.turns.end(turn.session_id)

    def _route_and_stream(
        self, prompt: PreparedPrompt, sampling: SamplingConfig, turn: _Turn
    ) -> Iterator[StreamEvent]:
        session_id, worker_id, allow_pull = turn.session_id, turn.worker_id, turn.allow_pull
        request_id = turn.request_id or uuid.uuid4().hex
        speculative: SpeculativeSend | None = None
        if worker_id:
            chosen, predicted, pull, matched = self._forced(prompt, worker_id, allow_pull)
        else:
            if self.config.speculative_dispatch:
                speculative = SpeculativeSend(
                    self.backend,
                    lambda d, rid: self._worker_request(
                        prompt, sampling, session_id, rid, d.pull, d.worker_id
                    ),
                )
            try:
                decision = self.route(
                    prompt,
                    session_id,
                    request_id,
                    turn.max_tokens,
                    commit=True,
                    speculative=speculative,
                )
            except BaseException:
                if speculative is not None:
                    speculative.abort()
                raise
            chosen, predicted, pull = (
                decision.worker_id,
                decision.predicted_prefill_ms,
                decision.pull,
            )
            matched = decision.matched_blocks
        if pull is not None:
            matched = pull.num_blocks
        outputs: Iterator[RequestOutput] | None = None
        if speculative is not None and speculative.stream is not None:
            assert speculative.request is not None and speculative.worker_id == chosen
            request, outputs = speculative.request, speculative.stream
        else:
            request = self._worker_request(prompt, sampling, session_id, request_id, pull, chosen)
        with self.lock:
            uncached = self.uncached_tokens(len(prompt.token_ids), matched)
            self.load.on_routed(request.request_id, chosen, predicted, uncached)
            self.counters.num_requests += 1
        if self.note_sink is not None:
            taken = RequestTaken(request.request_id, self.origin, len(prompt.token_ids), uncached)
            self.note_sink(NoteBatch(chosen, (taken,)))
        if outputs is None:
            # Handed to the backend now: a lazy backend (Ray) calls the worker on the first
            # read, an eager one (the simulator) queues the request at once.
            outputs = self.backend.generate(chosen, request)
        return RequestStream(
            self, chosen, request, outputs, started=turn.started, label=turn.label
        ).events(count_turn=turn.count)

    def _worker_request(
        self,
        prompt: PreparedPrompt,
        sampling: SamplingConfig,
        session_id: str,
        request_id: str,
        pull: PullPlan | None,
        chosen: WorkerId,
    ) -> WorkerRequest:
        spec = self._pull_spec(pull, chosen, prompt) if pull is not None else None
        return WorkerRequest(
            request_id,
            prompt.token_ids,
            sampling,
            prompt.cache_salt,
            spec,
            session_id,
            bypass_cache=prompt.bypass_cache,
            adapter=prompt.adapter,
            origin=self.origin,
            sent_at_s=time.time(),
        )

    def _pull_spec(
        self, pull: PullPlan, target: WorkerId, prompt: PreparedPrompt
    ) -> PullSpec | None:
        end = min(
            pull.num_blocks, num_reusable_blocks(len(prompt.token_ids), self.config.block_size)
        )
        if self.transfers is None or end <= pull.from_block:
            return None
        return PullSpec(
            pull.source,
            pull.from_block,
            prompt.block_hashes[pull.from_block : end],
            self.transfers.transport(pull.source, target),
        )

    def _forced(
        self, prompt: PreparedPrompt, worker_id: str, allow_pull: bool = True
    ) -> tuple[WorkerId, float, PullPlan | None, int]:
        """Placement chosen by the caller; a pull is still planned when a peer holds more.
        Returns the worker, its predicted prefill, the pull (if any) and its matched blocks."""
        if not self.registry.is_known(worker_id):
            raise InvalidRequest(f"unknown worker id {worker_id!r}")
        if worker_id not in self.registry.routable():
            raise NoLiveWorker(f"worker {worker_id!r} is not alive")
        live = self._routable_for(prompt.adapter)
        if worker_id not in live:
            raise InvalidRequest(f"worker {worker_id!r} does not serve adapter {prompt.adapter!r}")
        views = self.fleet.columns(prompt, live, self.cost_model)
        target = next(v for v in views if v.worker_id == worker_id)
        query = RouteQuery("", prompt.block_hashes, len(prompt.token_ids), self.config.block_size)
        price = self.transfers.price if self.transfers is not None else None
        peer = best_peer(views) if allow_pull else None
        option = cheapest_prefill(query, target, peer, self.cost_model, price)
        return target.worker_id, option.prefill_ms, option.pull, target.matched_blocks

    def _routable_for(self, adapter: str) -> tuple[str, ...]:
        """Routable workers serving `adapter`. No worker at all: UNAVAILABLE; workers, but none
        that serves the adapter: the adapter is unknown (INVALID_ARGUMENT)."""
        live = self.registry.routable_for(adapter)
        if live:
            return live
        if not adapter or not self.registry.routable():
            raise NoLiveWorker("no live worker can take the request")
        if adapter in self.registry.adapters():
            raise NoLiveWorker(f"no routable worker serves adapter {adapter!r} now")
        raise InvalidRequest(
            f"no worker serves adapter {adapter!r}; served: {self.registry.adapters()}"
        )

    def uncached_tokens(self, prompt_len: int, matched_blocks: int) -> int:
        """Prompt tokens the worker must prefill (the last one always is)."""
        return prompt_len - num_reusable_tokens(prompt_len, matched_blocks, self.config.block_size)

    def note_refused(self, label: str, outcome: str, reason: str, *, request_id: str = "") -> None:
        """A request refused before it reached a worker (invalid input, no live worker)."""
        if self.observers:
            self.notify(RequestRecord(request_id or label, label, outcome, reason=reason))

    def notify(self, record: RequestRecord) -> None:
        for observer in self.observers:
            observer.on_request_done(record)

    def forget_worker(self, worker_id: str) -> None:
        """A worker is gone (the registry's on_dead): drop its load and the policy's state."""
        with self.lock:
            self.load.forget_worker(WorkerId(worker_id))
            self.policy.on_worker_removed(WorkerId(worker_id))
            self.peer_routes.forget_worker(WorkerId(worker_id))

    def stats(self) -> dict[str, Any]:
        with self.lock:
            snapshot = self.counters.snapshot(self.turns.num_refused)
        snapshot["num_indexed_blocks"] = self.mirror.num_blocks
        snapshot["num_events_applied"] = self.mirror.num_events_applied
        return snapshot

    def observe_worker(self, worker_id: str, info: WorkerInfo) -> None:
        """Take a worker's own report: its load (every replica's requests) for routing, and its
        measured prefill cost, so prices follow the hardware (CPU and H100 differ by orders of
        magnitude)."""
        report = ReportedLoad(info.num_queued_prefill_tokens, info.num_running + info.num_waiting)
        self.registry.set_adapters(worker_id, info.adapters)
        with self.lock:
            self.load.on_reported(WorkerId(worker_id), report)
        measured = info.counters.prefill_ms_per_token
        if measured <= 0:
            return
        with self.lock:
            self.cost_model = self.cost_model.with_measured_prefill(measured)
            self.policy.cost_model = self.cost_model

    def observe_notes(self, batch: NoteBatch) -> None:
        """Take request notes about one worker: the requests other replicas routed to it count
        in this replica's load tracker from now on (`PeerRoutes`)."""
        if not self.registry.is_known(batch.worker_id):
            return
        with self.lock:
            self.peer_routes.apply(batch, self.cost_model, self.clock())

    def forget_peer_routes(self) -> None:
        """Request notes were skipped (the follower rebuilt from Redis): let go of the other
        replicas' requests, whose ends may be among them."""
        with self.lock:
            self.peer_routes.clear()

    def indexed_blocks_of(self, worker_id: str) -> int:
        return self.mirror.num_worker_blocks(WorkerId(worker_id))
