"""The simple policies: round-robin, least-loaded and session-sticky (the baselines any router
is measured against; none of them reads the cache)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import (
    RouteDecision,
    RouteQuery,
    RoutingPolicy,
    SessionMap,
    WorkerView,
)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cost_model, rng, clock)
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

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cost_model, rng, clock)
        self._sessions = SessionMap(self.max_sessions)
        self._fallback = LeastLoadedPolicy(cost_model, rng, clock)

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        sticky = self._sessions.get(query.session_id)
        if sticky is not None and any(v.worker_id == sticky for v in workers):
            costs = [0.0 if v.worker_id == sticky else 1.0 for v in workers]
            decision = self._pick_lowest(query, workers, costs)
        else:
            decision = self._fallback.choose(query, workers)
        self._sessions.remember(query.session_id, decision.worker_id)
        return decision

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        self._sessions.forget_worker(worker_id)
