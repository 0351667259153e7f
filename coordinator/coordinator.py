"""The request path, without gRPC: validate, hash, look up, route, stream from the worker.

prepare()  token ids (or text) -> validated prompt + chained block hashes        (proto/)
match()    block hashes -> per-worker held prefix, from the in-memory mirror    (index_mirror)
route()    prices every live worker and picks one                               (router)
generate() streams the chosen worker's outputs, keeping the load tracker honest (cluster)
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvmesh.coordinator.cluster.transfer_manager import TransferManager
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.index.mirror import IndexMirror, PrefixMatch, WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_tracker import LoadTracker
from kvmesh.coordinator.routing.pull_planner import PullPlan, best_peer, cheapest_prefill
from kvmesh.coordinator.routing.router import RouteDecision, RouteQuery, WorkerView, make_policy
from kvmesh.proto.block_hash import BlockHash, block_hashes, namespace_hash
from kvmesh.workers.engine.sampler import SamplingConfig
from kvmesh.workers.engine.worker import RequestOutput, WorkerRequest
from kvmesh.workers.model.model_config import ModelConfig


class InvalidRequest(ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT)."""


class NoLiveWorker(RuntimeError):
    """No worker can take the request (maps to UNAVAILABLE)."""


class WorkerDied(RuntimeError):
    """The worker's actor died during a call (maps to UNAVAILABLE when it cannot be migrated)."""


class WorkerBackend(Protocol):
    """What the coordinator needs from the cluster (the Ray shell implements it)."""

    def live_worker_ids(self) -> list[str]: ...
    def worker_ids(self) -> list[str]: ...
    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]: ...


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    cache_salt: str


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One step of a Generate stream, as the service sends it."""

    token_ids: tuple[int, ...]
    worker_id: str
    finished: bool
    finish_reason: str = ""
    cached_tokens: int = -1  # >= 0 on the first event only: reused from the worker's own pool
    computed_tokens: int = -1
    prompt_tokens: int = 0
    pulled_tokens: int = 0  # on the first event: fetched from a peer before the prefill


@dataclass(slots=True)
class Counters:
    num_requests: int = 0
    num_failed_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_migrations: int = 0
    per_worker: dict[str, dict[str, int]] = field(default_factory=dict)


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        model: ModelConfig,
        backend: WorkerBackend,
        mirror: IndexMirror,
        mirror_lock: threading.Lock,
        *,
        tokenizer: TextCodec | None = None,
        index_connected: Callable[[], bool] = lambda: True,
        worker_free_blocks: Callable[[str], tuple[int, int]] | None = None,
        cost_model: CostModel | None = None,
        transfers: TransferManager | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.backend = backend
        self.mirror = mirror
        self.mirror_lock = mirror_lock
        self.tokenizer = tokenizer
        self.index_connected = index_connected
        self._worker_free_blocks = worker_free_blocks or (lambda _w: (1 << 30, 1 << 30))
        self.cost_model = cost_model or CostModel()
        self.policy = make_policy(config.policy, self.cost_model, random.Random(config.route_seed))
        self.load = LoadTracker()
        self._lock = threading.Lock()  # guards policy, load tracker and counters
        self.counters = Counters()
        self.fingerprint = model.fingerprint()
        self.transfers = transfers
        if transfers is not None:
            self.policy.transfer_ms = transfers.price

    # ---- request preparation ------------------------------------------------------------------

    def prepare(self, token_ids: Sequence[int], prompt: str, cache_salt: str) -> PreparedPrompt:
        if token_ids and prompt:
            raise InvalidRequest("give either token_ids or prompt, not both")
        if prompt:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send token_ids")
            token_ids = self.tokenizer.encode(prompt)
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        context = self.model.max_position_embeddings
        if len(token_ids) >= context:
            raise InvalidRequest(
                f"prompt of {len(token_ids)} tokens leaves no room in the model's context of"
                f" {context} tokens"
            )
        vocab = self.model.vocab_size
        top = max(token_ids)
        if top >= vocab:
            raise InvalidRequest(f"token id {top} is outside the vocabulary [0, {vocab})")
        root = namespace_hash(self.fingerprint, "", cache_salt)
        hashes = block_hashes(token_ids, self.config.block_size, root)
        return PreparedPrompt(tuple(token_ids), tuple(hashes), cache_salt)

    def check_sampling(self, prompt: PreparedPrompt, sampling: SamplingConfig) -> None:
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens {sampling.max_tokens} is over the limit {self.config.max_tokens_limit}"
            )
        context = self.model.max_position_embeddings
        total = len(prompt.token_ids) + sampling.max_tokens
        if total > context:
            raise InvalidRequest(
                f"prompt ({len(prompt.token_ids)}) + max_tokens ({sampling.max_tokens}) = {total}"
                f" exceeds the model's context of {context} tokens"
            )

    # ---- lookup and routing -------------------------------------------------------------------

    def match(self, prompt: PreparedPrompt) -> dict[WorkerId, PrefixMatch]:
        if not self.index_connected():
            return {}  # a stale index must not steer traffic: route by load only
        with self.mirror_lock:
            return self.mirror.match(prompt.block_hashes)

    def views(self, prompt: PreparedPrompt, workers: Sequence[str]) -> list[WorkerView]:
        matches = self.match(prompt)
        views = []
        for w in workers:
            m = matches.get(WorkerId(w), PrefixMatch(0, 0))
            num_blocks, num_free = self._worker_free_blocks(w)
            views.append(
                WorkerView(
                    WorkerId(w),
                    num_blocks,
                    num_free,
                    self.load.queued_prefill_ms(WorkerId(w)),
                    self.load.queued_prefill_tokens(WorkerId(w)),
                    self.load.num_running(WorkerId(w)),
                    m.num_blocks,
                    m.num_device_blocks,
                )
            )
        return views

    def route(
        self, prompt: PreparedPrompt, session_id: str = "", request_id: str = ""
    ) -> RouteDecision:
        live = self.backend.live_worker_ids()
        if not live:
            raise NoLiveWorker("no live worker can take the request")
        query = RouteQuery(
            request_id or uuid.uuid4().hex,
            prompt.block_hashes,
            len(prompt.token_ids),
            self.config.block_size,
            session_id,
        )
        with self._lock:
            return self.policy.choose(query, self.views(prompt, live))

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
    ) -> Iterator[StreamEvent]:
        """Route (unless `worker_id` forces placement) and stream the worker's outputs.
        `allow_pull=False` with `worker_id` serves from that worker's own cache only, as a
        standalone engine would (the per-worker HTTP endpoints that peer routers front)."""
        self.check_sampling(prompt, sampling)
        request_id = request_id or uuid.uuid4().hex
        if worker_id:
            chosen, predicted, pull, matched = self._forced(prompt, worker_id, allow_pull)
        else:
            decision = self.route(prompt, session_id, request_id)
            chosen, predicted, pull = (
                decision.worker_id,
                decision.predicted_prefill_ms,
                decision.pull,
            )
            matched = decision.matched_blocks
        if pull is not None:
            matched = pull.num_blocks
        with self._lock:
            uncached = self._uncached_tokens(len(prompt.token_ids), matched)
            self.load.on_routed(request_id, chosen, predicted, uncached)
            self.counters.num_requests += 1
        pulled_tokens = 0
        if pull is not None and self.transfers is not None:
            root = namespace_hash(self.fingerprint, "", prompt.cache_salt)
            pulled_tokens = self.transfers.execute(pull, chosen, prompt.block_hashes, root)
        request = WorkerRequest(request_id, prompt.token_ids, sampling, prompt.cache_salt)
        return self._stream(chosen, request, pulled_tokens)

    def _forced(
        self, prompt: PreparedPrompt, worker_id: str, allow_pull: bool = True
    ) -> tuple[WorkerId, float, PullPlan | None, int]:
        """Placement chosen by the caller; a pull is still planned when a peer holds more.
        Returns the worker, its predicted prefill, the pull (if any) and its matched blocks."""
        if worker_id not in self.backend.worker_ids():
            raise InvalidRequest(f"unknown worker id {worker_id!r}")
        live = self.backend.live_worker_ids()
        if worker_id not in live:
            raise NoLiveWorker(f"worker {worker_id!r} is not alive")
        views = self.views(prompt, live)
        target = next(v for v in views if v.worker_id == worker_id)
        query = RouteQuery("", prompt.block_hashes, len(prompt.token_ids), self.config.block_size)
        price = self.transfers.price if self.transfers is not None else None
        peer = best_peer(views) if allow_pull else None
        option = cheapest_prefill(query, target, peer, self.cost_model, price)
        return target.worker_id, option.prefill_ms, option.pull, target.matched_blocks

    def _uncached_tokens(self, prompt_len: int, matched_blocks: int) -> int:
        """Prompt tokens the worker must prefill (the last one always is)."""
        return prompt_len - min(matched_blocks * self.config.block_size, prompt_len - 1)

    def _stream(
        self, worker: WorkerId, request: WorkerRequest, pulled_tokens: int = 0
    ) -> Iterator[StreamEvent]:
        """The worker's outputs as stream events. If the worker dies mid-stream, the request
        moves to another live worker with its prompt plus the tokens already streamed (at most
        `max_migrations` times), so the client sees a slower stream, not an error."""
        ok = False
        produced: list[int] = []
        migrations = 0
        current = request
        try:
            while True:
                try:
                    for event in self._events(worker, current, pulled_tokens, request):
                        produced.extend(event.token_ids)
                        yield event
                        if event.finished:
                            ok = True
                            return
                    return  # the worker's stream ended without a final output
                except WorkerDied:
                    migrations += 1
                    if migrations > self.config.max_migrations:
                        raise
                    worker, current = self._migrate(worker, request, produced, migrations)
                    pulled_tokens = 0
        finally:
            with self._lock:
                self.load.on_finished(current.request_id)
                self.policy.on_request_done(current.request_id)
                if current is not request:
                    self.policy.on_request_done(request.request_id)
                if not ok:
                    self.counters.num_failed_requests += 1

    def _events(
        self, worker: WorkerId, request: WorkerRequest, pulled_tokens: int, original: WorkerRequest
    ) -> Iterator[StreamEvent]:
        for out in self.backend.generate(worker, request):
            pulled = 0
            if out.cached_tokens >= 0:
                pulled = min(pulled_tokens, out.cached_tokens)
                self._on_prefilled(worker, request, out, pulled)
            with self._lock:
                self.counters.generated_tokens += len(out.new_token_ids)
            yield StreamEvent(
                out.new_token_ids,
                worker,
                out.finished,
                out.finish_reason,
                out.cached_tokens - pulled if out.cached_tokens >= 0 else -1,
                out.computed_tokens,
                len(original.prompt_ids),
                pulled,
            )

    def _migrate(
        self, dead: WorkerId, original: WorkerRequest, produced: list[int], attempt: int
    ) -> tuple[WorkerId, WorkerRequest]:
        """Re-route what is left of `original` after its worker died."""
        with self._lock:
            self.load.forget_worker(dead)
            self.counters.num_migrations += 1
        remaining = original.sampling.max_tokens - len(produced)
        if remaining < 1:
            raise WorkerDied(dead)  # nothing left to generate but the final message was lost
        prompt = self.prepare(list(original.prompt_ids) + produced, "", original.cache_salt)
        request_id = f"{original.request_id}.m{attempt}"
        decision = self.route(prompt, request_id=request_id)  # raises NoLiveWorker if none
        with self._lock:
            uncached = self._uncached_tokens(len(prompt.token_ids), decision.matched_blocks)
            self.load.on_routed(
                request_id, decision.worker_id, decision.predicted_prefill_ms, uncached
            )
        sampling = replace(original.sampling, max_tokens=remaining)
        return decision.worker_id, WorkerRequest(
            request_id, prompt.token_ids, sampling, original.cache_salt
        )

    def _on_prefilled(
        self, worker: WorkerId, request: WorkerRequest, out: RequestOutput, pulled: int
    ) -> None:
        with self._lock:
            self.load.on_prefilled(request.request_id)
            c = self.counters
            c.prompt_tokens += len(request.prompt_ids)
            c.pulled_tokens += pulled
            c.cached_tokens += out.cached_tokens - pulled
            c.computed_tokens += out.computed_tokens
            w = c.per_worker.setdefault(worker, {"cached_tokens": 0, "computed_tokens": 0})
            w["cached_tokens"] += out.cached_tokens - pulled
            w["computed_tokens"] += out.computed_tokens

    def on_worker_dead(self, worker_id: str) -> None:
        with self._lock:
            self.load.forget_worker(WorkerId(worker_id))
            self.policy.on_worker_removed(WorkerId(worker_id))
        with self.mirror_lock:
            self.mirror.remove_worker(WorkerId(worker_id))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            snapshot = {
                "num_requests": c.num_requests,
                "num_failed_requests": c.num_failed_requests,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "pulled_tokens": c.pulled_tokens,
                "computed_tokens": c.computed_tokens,
                "generated_tokens": c.generated_tokens,
                "num_migrations": c.num_migrations,
                "hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            }
        with self.mirror_lock:
            snapshot["num_indexed_blocks"] = self.mirror.num_blocks
            snapshot["num_events_applied"] = self.mirror.num_events_applied
        return snapshot

    def observe_worker(self, worker_id: str, info: dict[str, Any]) -> None:
        """Fold a worker's measured prefill cost into the router's cost model, so prices follow
        the hardware (a CPU worker and an H100 differ by orders of magnitude)."""
        measured = float(info.get("counters", {}).get("prefill_ms_per_token", 0.0))
        if measured <= 0:
            return
        with self._lock:
            self.cost_model = self.cost_model.with_measured_prefill(measured)
            self.policy.cost_model = self.cost_model

    def indexed_blocks_of(self, worker_id: str) -> int:
        with self.mirror_lock:
            return self.mirror.num_worker_blocks(WorkerId(worker_id))
