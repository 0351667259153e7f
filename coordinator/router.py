"""Routing policies: kvmesh's continuous cost and the simple baselines, plus the registry.

The interface (`WorkerView`, `RouteQuery`, `RouteDecision`, `RoutingPolicy`) lives in
`policy_base` and is re-exported here; reimplementations of other systems' routers live in
`baseline_policies`. `POLICIES` names every policy a user can pick (`kvmesh up --policy NAME`,
`kvmesh simulate --policies ...`); `make_policy` builds one.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvmesh.coordinator.baseline_policies import DynamoKvPolicy, SglangCacheAwarePolicy
from kvmesh.coordinator.cost_model import CostModel
from kvmesh.coordinator.index_mirror import WorkerId
from kvmesh.coordinator.policy_base import (
    RouteDecision,
    RouteQuery,
    RoutingPolicy,
    WorkerScore,
    WorkerView,
)
from kvmesh.coordinator.pull_planner import cheapest_prefill

__all__ = [
    "POLICIES",
    "DynamoKvPolicy",
    "KvmeshPolicy",
    "LeastLoadedPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteQuery",
    "RoutingPolicy",
    "SessionStickyPolicy",
    "SglangCacheAwarePolicy",
    "WorkerScore",
    "WorkerView",
    "make_policy",
]


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
        self._session_to_worker: OrderedDict[str, WorkerId] = OrderedDict()
        self._fallback = LeastLoadedPolicy(cost_model, rng, clock)

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

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cost_model, rng, clock)
        self._session_to_worker: OrderedDict[str, WorkerId] = OrderedDict()

    def worker_cost(
        self,
        query: RouteQuery,
        w: WorkerView,
        sticky: WorkerId | None,
        peer: WorkerView | None = None,
    ) -> float:
        """`peer`: the worker holding the longest device prefix, when pulls are priced."""
        cm = self.cost_model
        option = cheapest_prefill(query, w, peer, cm, self.transfer_ms)
        cost = w.queued_prefill_ms + option.prefill_ms
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
        costs = [self.worker_cost(query, w, sticky, workers) for w in workers]
        decision = self._pick_lowest(query, workers, costs)
        if self.transfer_ms is not None:
            chosen = next(w for w in workers if w.worker_id == decision.worker_id)
            option = cheapest_prefill(query, chosen, workers, self.cost_model, self.transfer_ms)
            if option.pull is not None:
                decision = replace(
                    decision, pull=option.pull, predicted_prefill_ms=option.prefill_ms
                )
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
    p.name: p
    for p in (
        KvmeshPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        SessionStickyPolicy,
        SglangCacheAwarePolicy,
        DynamoKvPolicy,
    )
}


def make_policy(
    name: str,
    cost_model: CostModel,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
) -> RoutingPolicy:
    """A fresh policy; `clock` (seconds) is what time-based policies (SGLang's tree) read."""
    try:
        policy_type = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None
    return policy_type(cost_model, rng, clock)
