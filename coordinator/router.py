"""Routing policies behind one interface, so the service and the simulator can swap them.

Every policy sees the same facts per live worker (`WorkerView`: how much of the prompt it holds,
how much prefill work is queued on it, how many sequences it decodes) and returns a decision.
Policies that keep their own state (round-robin's cursor, SGLang's approximate tree) keep it in
the instance; randomness comes from the `random.Random` passed in, so runs are reproducible.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvmesh.coordinator.cost_model import CostModel
from kvmesh.coordinator.index_mirror import WorkerId
from kvmesh.proto.block_hash import BlockHash

_TIE_EPSILON_MS = 1e-9


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: WorkerId
    num_blocks: int  # pool capacity
    num_free_blocks: int  # free (possibly cached) blocks the worker last reported
    queued_prefill_ms: float  # predicted prefill work routed here and not yet done
    queued_prefill_tokens: int
    num_running: int  # sequences routed here and not finished
    matched_blocks: int  # leading prompt blocks this worker holds (any tier)
    matched_device_blocks: int  # ... of which the leading run on the device tier


@dataclass(frozen=True, slots=True)
class RouteQuery:
    request_id: str
    block_hashes: Sequence[BlockHash]
    prompt_len: int
    block_size: int
    session_id: str = ""

    @property
    def num_prompt_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)


@dataclass(frozen=True, slots=True)
class WorkerScore:
    worker_id: WorkerId
    matched_blocks: int
    cost_ms: float


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: WorkerId
    matched_blocks: int
    cost_ms: float
    predicted_prefill_ms: float  # what the load tracker should queue on the chosen worker
    scores: tuple[WorkerScore, ...]


class RoutingPolicy(ABC):
    """Contract: `choose` gets at least one worker and returns one of them; it never blocks."""

    name: ClassVar[str]

    def __init__(self, cost_model: CostModel, rng: random.Random) -> None:
        self.cost_model = cost_model
        self.rng = rng

    @abstractmethod
    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision: ...

    def on_worker_removed(self, worker_id: WorkerId) -> None:  # noqa: B027 - optional hook
        """Forget any state about a worker that left."""

    def _pick_lowest(
        self, query: RouteQuery, workers: Sequence[WorkerView], costs: Sequence[float]
    ) -> RouteDecision:
        if not workers:
            raise ValueError("no workers to route to")
        best = min(costs)
        tied = [i for i, c in enumerate(costs) if c <= best + _TIE_EPSILON_MS]
        i = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        w = workers[i]
        scores = tuple(
            WorkerScore(v.worker_id, v.matched_blocks, c)
            for v, c in zip(workers, costs, strict=True)
        )
        return RouteDecision(
            w.worker_id, w.matched_blocks, costs[i], self._prefill_ms(query, w), scores
        )

    def _prefill_ms(self, query: RouteQuery, w: WorkerView) -> float:
        cached = self._cached_tokens(query, w)
        return self.cost_model.prefill_ms(query.prompt_len - cached, cached)

    @staticmethod
    def _cached_tokens(query: RouteQuery, w: WorkerView) -> int:
        # The last prompt token is always computed (its logits start decoding).
        return min(w.matched_blocks * query.block_size, query.prompt_len - 1)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, cost_model: CostModel, rng: random.Random) -> None:
        super().__init__(cost_model, rng)
        self._next = 0

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        ordered = sorted(workers, key=lambda v: v.worker_id)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        costs = [0.0 if v is w else 1.0 for v in ordered]
        return self._pick_lowest(query, ordered, costs)


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest queued prefill tokens, then fewest running sequences; ignores the cache."""

    name = "least_loaded"

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        costs = [
            v.queued_prefill_ms + self.cost_model.decode_step_ms(v.num_running) for v in workers
        ]
        return self._pick_lowest(query, workers, costs)


class SessionStickyPolicy(RoutingPolicy):
    """A session stays on the worker it first landed on (least-loaded); no session: least-loaded."""

    name = "session_sticky"
    max_sessions = 100_000

    def __init__(self, cost_model: CostModel, rng: random.Random) -> None:
        super().__init__(cost_model, rng)
        self._session_to_worker: OrderedDict[str, WorkerId] = OrderedDict()
        self._fallback = LeastLoadedPolicy(cost_model, rng)

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        sticky = self._session_to_worker.get(query.session_id) if query.session_id else None
        if sticky is not None and any(v.worker_id == sticky for v in workers):
            costs = [0.0 if v.worker_id == sticky else 1.0 for v in workers]
            decision = self._pick_lowest(query, workers, costs)
        else:
            decision = self._fallback.choose(query, workers)
        if query.session_id:
            self._session_to_worker[query.session_id] = decision.worker_id
            self._session_to_worker.move_to_end(query.session_id)
            if len(self._session_to_worker) > self.max_sessions:
                self._session_to_worker.popitem(last=False)
        return decision

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        for s in [s for s, w in self._session_to_worker.items() if w == worker_id]:
            del self._session_to_worker[s]


class KvmeshPolicy(RoutingPolicy):
    """One continuous cost per worker; the lowest wins, ties break randomly.

        cost(w) = queue(w) + prefill(uncached on w) + decode_pressure(w) + memory_pressure(w)
                  - session_affinity(w)

    A worker that holds more of the prompt saves prefill; a busy one pays its queue. There is no
    threshold: a long cached prefix wins until the queue it builds costs more than recomputing.
    """

    name = "kvmesh"
    max_sessions = 100_000

    def __init__(self, cost_model: CostModel, rng: random.Random) -> None:
        super().__init__(cost_model, rng)
        self._session_to_worker: OrderedDict[str, WorkerId] = OrderedDict()

    def worker_cost(self, query: RouteQuery, w: WorkerView, sticky: WorkerId | None) -> float:
        cm = self.cost_model
        cached = self._cached_tokens(query, w)
        cost = w.queued_prefill_ms + cm.prefill_ms(query.prompt_len - cached, cached)
        if w.num_running:
            cost += cm.decode_step_ms(w.num_running)
        needed_blocks = query.num_prompt_blocks - w.matched_device_blocks
        if needed_blocks > w.num_free_blocks:
            # The worker must wait for running sequences to finish (or preempt one).
            cost += cm.decode_step_ms(w.num_running) * query.block_size
        if sticky == w.worker_id:
            cost -= cm.prefill_per_token_ms * query.block_size
        return cost

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        sticky = self._session_to_worker.get(query.session_id) if query.session_id else None
        costs = [self.worker_cost(query, w, sticky) for w in workers]
        decision = self._pick_lowest(query, workers, costs)
        if query.session_id:
            self._session_to_worker[query.session_id] = decision.worker_id
            self._session_to_worker.move_to_end(query.session_id)
            if len(self._session_to_worker) > self.max_sessions:
                self._session_to_worker.popitem(last=False)
        return decision

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        for s in [s for s, w in self._session_to_worker.items() if w == worker_id]:
            del self._session_to_worker[s]


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (KvmeshPolicy, RoundRobinPolicy, LeastLoadedPolicy, SessionStickyPolicy)
}


def make_policy(name: str, cost_model: CostModel, rng: random.Random) -> RoutingPolicy:
    try:
        return POLICIES[name](cost_model, rng)
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None
