"""Routing policies: kvmesh's continuous cost and the simple baselines, plus the registry.

The interface (`WorkerView`, `RouteQuery`, `RouteDecision`, `RoutingPolicy`) lives in
`policy_base` and is re-exported here; reimplementations of other systems' routers live in
`baseline_policies`. `POLICIES` names every policy a user can pick (`kvmesh up --policy NAME`,
`kvmesh simulate --policies ...`); `make_policy` builds one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.baselines import DynamoKvPolicy, SglangCacheAwarePolicy
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import (
    RouteDecision,
    RouteQuery,
    RoutingPolicy,
    SessionMap,
    WorkerScore,
    WorkerView,
)
from kvmesh.coordinator.routing.pull_planner import PrefillOption, best_peer, cheapest_prefill
from kvmesh.coordinator.routing.recent_load import RecentLoad
from kvmesh.coordinator.routing.routed_prefixes import RoutedPrefixes
from kvmesh.coordinator.routing.running_context import RunningContext

__all__ = [
    "POLICIES",
    "DynamoKvPolicy",
    "KvmeshPolicy",
    "KvmeshWeights",
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


@dataclass(frozen=True, slots=True)
class KvmeshWeights:
    """The knobs of kvmesh's cost (defaults tuned with `kvmesh simulate`, docs/benchmarks.md)."""

    recompute_weight: float = 1.0
    """Recomputed prefill is counted (1 + this) times: once as this request's latency, and again
    as GPU time taken from the requests that queue behind it later. 0 is purely greedy."""
    placement_balance: float = 0.3
    """Weight of the work recently routed to a worker, scaled by the share of the prompt it would
    compute: new prefixes go where little was placed lately, since their followers come too."""
    request_balance: float = 0.1
    """Weight of the requests recently routed to a worker, scaled by the cheapest prefill of
    this prompt anywhere: keeps a hot prefix's holder from taking every follower."""
    balance_horizon_s: float = 10.0
    """How far back "recently" reaches (exponential decay time)."""
    routed_prefix_ttl_s: float = 30.0
    """How long a routed prompt counts as held by its worker before the index confirms it."""
    decode_tokens: float = 16.0
    """Output tokens over which a worker's decode load is priced: each of this request's steps on
    w is slower by what w's batch reads more than the lightest worker's, and the request makes
    each of theirs slower as much, so the difference is paid twice per token. Fewer than a
    typical answer's tokens, since batches even out as sequences finish. 0 prices one step."""
    session_affinity_blocks: float = 1.0
    """A session's pull towards the worker its last turn went to, in blocks of prefill time
    (`CoordinatorConfig.session_affinity_blocks`); 0 disables."""

    def __post_init__(self) -> None:
        for name in (
            "recompute_weight",
            "placement_balance",
            "request_balance",
            "decode_tokens",
            "session_affinity_blocks",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("balance_horizon_s", "routed_prefix_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class KvmeshPolicy(RoutingPolicy):
    """One continuous cost per worker, in milliseconds; the lowest wins, ties break randomly.

        cost(w) = queue(w)                 prefill work routed to w and not yet done
                + ready(w)                 prefill of what w lacks (after a pull, when cheaper)
                + r * recompute(w)         that recompute again, as work taken from later requests
                + decode_step(w)           the running batch rides along the prefill
                + decode_batch(w)          2 * tokens * (step_load(w) - least step_load)
                + memory(w)                ramps up as the prompt's new blocks outgrow w's free ones
                + p * recent_work(w) * uncached_share(w)
                + q * recent_requests(w) * min over workers of ready
                - session_affinity(w)     a blocks' prefill, on the session's last worker

    (recent_* are measured above the least-loaded worker's, so only differences count.) A worker
    that holds more of the prompt saves prefill and recompute; a busy one pays its queue. Nothing
    switches at a threshold: a cached prefix wins until the queue it builds costs more than
    recomputing twice, and a hot prefix's holder keeps its followers only until the decode batch
    they build there costs more than pulling (or recomputing) the prefix on a quieter worker:
    the prefix is replicated as soon as, and only as far as, balance asks. The index only learns
    of a prefix once its prefill is done, so prompts routed in the last `routed_prefix_ttl_s`
    count as held by their worker (`RoutedPrefixes`): a burst sharing a new prefix lands together
    instead of being recomputed everywhere.
    """

    name = "kvmesh"
    max_sessions = 100_000

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        weights: KvmeshWeights | None = None,
    ) -> None:
        super().__init__(cost_model, rng, clock)
        self.weights = weights or KvmeshWeights()
        self._sessions = SessionMap(self.max_sessions)
        self._routed = RoutedPrefixes(self.weights.routed_prefix_ttl_s)
        self._recent = RecentLoad(self.weights.balance_horizon_s)
        self._running = RunningContext()

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        if not workers:
            raise ValueError("no workers to route to")
        now = self.clock()
        self._routed.expire(now)
        self._running.expire(now)
        views = self._with_routed_prefixes(query, workers)
        peer = best_peer(views) if self.transfer_ms is not None else None
        options = [
            cheapest_prefill(query, w, peer, self.cost_model, self.transfer_ms) for w in views
        ]
        costs = self._costs(query, views, options, now)
        decision = self._pick_lowest(query, views, costs)
        sticky = self._sessions.get(query.session_id)
        if sticky is not None:
            decision = replace(
                decision,
                session_worker_id=sticky,
                session_affinity_ms=self._session_affinity_ms(query),
            )
        chosen = next(i for i, w in enumerate(views) if w.worker_id == decision.worker_id)
        option = options[chosen]
        if option.pull is not None:
            decision = replace(decision, pull=option.pull, predicted_prefill_ms=option.prefill_ms)
        self._remember(query, decision, workers[chosen].matched_blocks, now)
        return decision

    def _with_routed_prefixes(
        self, query: RouteQuery, workers: Sequence[WorkerView]
    ) -> Sequence[WorkerView]:
        if not len(self._routed):
            return workers
        out = []
        for w in workers:
            held = self._routed.extend(w.worker_id, query.block_hashes, w.matched_blocks)
            # Only the local match grows: a routed prefix is not yet there for a peer to pull.
            out.append(w if held == w.matched_blocks else w._replace(matched_blocks=held))
        return out

    def _costs(
        self,
        query: RouteQuery,
        views: Sequence[WorkerView],
        options: Sequence[PrefillOption],
        now: float,
    ) -> list[float]:
        cm, weights, recent = self.cost_model, self.weights, self._recent
        sticky = self._sessions.get(query.session_id)
        work, requests = recent.snapshot([w.worker_id for w in views], now)
        least_work, least_requests = min(work), min(requests)
        cheapest_ready = min(o.prefill_ms for o in options)
        # Decode is paid per token, by this request and by every sequence it joins (see
        # `KvmeshWeights.decode_tokens`): what a hot prefix's holder's growing batch costs.
        step_loads = [self._decode_load_ms(w) for w in views]
        least_step_load = min(step_loads)
        costs = []
        for w, option, w_work, w_requests, step_load in zip(
            views, options, work, requests, step_loads, strict=True
        ):
            recompute_ms = option.prefill_ms - (option.pull.transfer_ms if option.pull else 0.0)
            cost = w.queued_prefill_ms + option.prefill_ms + weights.recompute_weight * recompute_ms
            if w.num_running:
                cost += cm.decode_step_ms(w.num_running)
            cost += 2.0 * weights.decode_tokens * (step_load - least_step_load)
            if query.num_prompt_blocks - w.matched_device_blocks > w.num_free_blocks:
                cost += self._memory_pressure_ms(query, w)
            uncached_share = 1.0 - self._cached_tokens(query, w) / query.prompt_len
            cost += weights.placement_balance * (w_work - least_work) * uncached_share
            cost += weights.request_balance * (w_requests - least_requests) * cheapest_ready
            if sticky == w.worker_id:
                cost -= self._session_affinity_ms(query)
            costs.append(cost)
        return costs

    def _decode_load_ms(self, w: WorkerView) -> float:
        """What w's running batch adds to each decode step: the KV its requests read
        (`RunningContext`) when the cost model knows a KV token's read cost; else its size."""
        cm = self.cost_model
        if cm.decode_per_kv_token_ms > 0:
            return cm.decode_kv_ms(self._running.tokens(w.worker_id))
        return w.num_running * cm.decode_per_seq_ms

    def _session_affinity_ms(self, query: RouteQuery) -> float:
        blocks = self.weights.session_affinity_blocks
        return blocks * self.cost_model.prefill_per_token_ms * query.block_size

    def _memory_pressure_ms(self, query: RouteQuery, w: WorkerView) -> float:
        """0 while the prompt's new blocks fit in w's free blocks; then up to one block's worth of
        decode steps (running sequences must finish, or be preempted, to make room)."""
        needed = query.num_prompt_blocks - w.matched_device_blocks
        if needed <= 0 or needed <= w.num_free_blocks:
            return 0.0
        shortfall = (needed - w.num_free_blocks) / needed
        return shortfall * self.cost_model.decode_step_ms(w.num_running) * query.block_size

    def _remember(
        self, query: RouteQuery, decision: RouteDecision, indexed: int, now: float
    ) -> None:
        """`indexed`: the chosen worker's match in the index, before routed prefixes."""
        hashes = query.block_hashes
        self._routed.add(query.request_id, decision.worker_id, hashes, now, indexed)
        self._recent.add(decision.worker_id, decision.predicted_prefill_ms, now)
        self._running.add(query.request_id, decision.worker_id, query.prompt_len, now)
        self._sessions.remember(query.session_id, decision.worker_id)

    def on_request_done(self, request_id: str) -> None:
        self._routed.discard(request_id)
        self._running.discard(request_id)

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        self._sessions.forget_worker(worker_id)
        self._routed.forget_worker(worker_id)
        self._recent.forget(worker_id)
        self._running.forget_worker(worker_id)


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
    *,
    session_affinity_blocks: float | None = None,
) -> RoutingPolicy:
    """A fresh policy; `clock` (seconds) is what time-based policies (SGLang's tree) read;
    `session_affinity_blocks` overrides the kvmesh policy's session term (others ignore it)."""
    try:
        policy_type = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None
    if policy_type is KvmeshPolicy and session_affinity_blocks is not None:
        weights = KvmeshWeights(session_affinity_blocks=session_affinity_blocks)
        return KvmeshPolicy(cost_model, rng, clock, weights)
    return policy_type(cost_model, rng, clock)
