"""The reference for kvmesh's cost: the policy priced one worker at a time, in plain Python.

`KvmeshPolicy` (kvmesh_policy.py) prices every worker at once over columns; this subclass keeps the
same state and prices the same terms with one loop over `WorkerView`s, as the router did before
it was vectorised. It is not for serving: a test drives both on the same inputs and requires the
same decisions, so a term changed in one place and not the other is caught. Change a term here
first, then in `KvmeshPolicy._costs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.policy import RouteDecision, RouteQuery, WorkerView
from kvmesh.coordinator.routing.pull_planner import PrefillOption, best_peer, cheapest_prefill


class KvmeshReferencePolicy(KvmeshPolicy):
    """kvmesh's cost, one worker at a time (see `KvmeshPolicy` for the terms)."""

    name = "kvmesh_reference"

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        if not workers:
            raise ValueError("no workers to route to")
        workers = list(workers)
        now = self.clock()
        self._routed.expire(now)
        self._running.expire(now)
        self._reused.expire(now)
        views = self._with_routed_prefixes(query, workers)
        peer = best_peer(views) if self.transfer_ms is not None else None
        options = [
            cheapest_prefill(query, w, peer, self.cost_model, self.transfer_ms) for w in views
        ]
        costs = self._scalar_costs(query, views, options, now, workers)
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

    def _scalar_costs(
        self,
        query: RouteQuery,
        views: Sequence[WorkerView],
        options: Sequence[PrefillOption],
        now: float,
        indexed: Sequence[WorkerView],
    ) -> list[float]:
        """`indexed`: the views before routed prefixes extended their matches."""
        cm, weights, recent = self.cost_model, self.weights, self._recent
        sticky = self._sessions.get(query.session_id)
        work, requests = recent.snapshot([w.worker_id for w in views], now)
        least_work, least_requests = min(work), min(requests)
        cheapest_ready = min(o.prefill_ms for o in options)
        step_loads = [self._decode_load_ms(w) for w in views]
        least_step_load = min(step_loads)
        decode_tokens = weights.decode_tokens_for(query.max_tokens)
        new_prefixes = self._new_prefix_counts(query, views, now)
        least_new = min(new_prefixes) if new_prefixes is not None else 0.0
        costs = []
        for i, (w, option, w_work, w_requests, step_load, w_indexed) in enumerate(
            zip(views, options, work, requests, step_loads, indexed, strict=True)
        ):
            recompute_ms = option.prefill_ms - (option.pull.transfer_ms if option.pull else 0.0)
            cost = w.queued_prefill_ms + option.prefill_ms + weights.recompute_weight * recompute_ms
            if w.num_running:
                cost += cm.decode_step_ms(w.num_running)
            kv_ms = self._kv_read_ms(w)
            cost += w.num_queued * (cm.decode_step_ms(w.num_running) + kv_ms)
            cost += 2.0 * decode_tokens * (step_load - least_step_load)
            stored = self._stored_blocks(query, w, w_indexed)
            cost += self._memory_ms(query, w, stored, cm.decode_step_ms(w.num_running) + kv_ms)
            cost += self._eviction_ms(query, w, stored)
            uncached_share = 1.0 - self._cached_tokens(query, w) / query.prompt_len
            cost += weights.placement_balance * (w_work - least_work) * uncached_share
            cost += weights.request_balance * (w_requests - least_requests) * cheapest_ready
            if new_prefixes is not None:
                cost += weights.new_prefix_balance * (new_prefixes[i] - least_new) * cheapest_ready
            if sticky == w.worker_id:
                cost -= self._session_affinity_ms(query)
            costs.append(cost)
        return costs

    def _new_prefix_counts(
        self, query: RouteQuery, views: Sequence[WorkerView], now: float
    ) -> list[float] | None:
        """Prompts each worker was lately given from scratch, where this prompt is one no worker
        holds any of (routed prefixes included); else None (see `KvmeshPolicy`)."""
        cold = bool(query.block_hashes) and all(w.matched_blocks == 0 for w in views)
        if not (self.weights.new_prefix_balance > 0 and cold):
            return None
        return self._new_prefixes.snapshot([w.worker_id for w in views], now)[1]

    def _decode_load_ms(self, w: WorkerView) -> float:
        cm = self.cost_model
        if cm.decode_per_kv_token_ms > 0:
            return cm.decode_kv_ms(self._running.tokens(w.worker_id))
        return w.num_running * cm.decode_per_seq_ms

    def _kv_read_ms(self, w: WorkerView) -> float:
        """What w's running requests' KV adds to each step (0 without a calibrated model)."""
        cm = self.cost_model
        if cm.decode_per_kv_token_ms > 0:
            return cm.decode_kv_ms(self._running.tokens(w.worker_id))
        return 0.0

    @staticmethod
    def _stored_blocks(query: RouteQuery, w: WorkerView, indexed: WorkerView) -> int:
        """Prompt blocks w would store (computed or pulled): what it lacks on its device, less a
        prefix routed there and not yet indexed (it will be there)."""
        if w.matched_blocks > indexed.matched_blocks:
            held = w.matched_blocks
        else:
            held = w.matched_device_blocks
        return max(query.num_prompt_blocks - held, 0)

    def _memory_ms(self, query: RouteQuery, w: WorkerView, stored: int, step_ms: float) -> float:
        """The blocks the request holds on w for its answer's steps, as the share of w's pool:
        the prompt blocks it stores times the share of the pool in use, its answer's times the
        square of it (see `KvmeshPolicy`)."""
        weights = self.weights
        if not weights.memory_weight > 0:
            return 0.0
        answer_len = weights.answer_tokens_for(query.max_tokens)
        pool = max(w.num_blocks, 1)
        in_use = 1.0 - w.num_free_blocks / pool
        blocks = stored * in_use + answer_len / query.block_size * (in_use * in_use)
        held_ms = blocks / pool * answer_len * step_ms
        return weights.memory_weight * held_ms

    def _eviction_ms(self, query: RouteQuery, w: WorkerView, stored: int) -> float:
        """The blocks w stores for the prompt, each priced as its prefill times the share of w's
        pool that its lately reused prefixes fill (see `KvmeshPolicy`)."""
        if not self.weights.eviction_weight > 0 or stored <= 0:
            return 0.0
        share = min(1.0, self._reused.num_blocks(w.worker_id) / max(w.num_blocks, 1))
        block_ms = self.weights.eviction_weight * (
            self.cost_model.prefill_per_token_ms * query.block_size
        )
        return block_ms * stored * share
