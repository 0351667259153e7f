"""Other systems' default routers, reimplemented behind our interface so the simulator can compare.

These are written from the projects' documentation and the behaviour of their routers (no code is
copied). Each keeps what its original keeps and sees only what its original sees: SGLang's router
never reads the workers' caches, it remembers where it sent prompts; Dynamo's reads the KV-event
index (our mirror's `matched_blocks`) and tracks the blocks of the requests it has in flight.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import RouteDecision, RouteQuery, RoutingPolicy, WorkerView
from kvmesh.proto.block_hash import BlockHash


@dataclass(slots=True)
class _TreeNode:
    depth: int  # blocks from the root, this one included
    tenant_to_last_access: dict[WorkerId, float] = field(default_factory=dict)


class SglangCacheAwarePolicy(RoutingPolicy):
    """SGLang router's `cache_aware` policy with its defaults.

    As SGLang's router does by default, for each request:

      1. Load is the number of requests the router has in flight per worker. The system is
         *imbalanced* when both  max - min > 64  and  max > 1.5 * min;  then the request goes to
         the least-loaded worker (shortest queue), cache ignored.
      2. Otherwise the router looks the prompt up in its *approximate* radix tree: a tree of the
         prompts it has itself routed, each node tagged with the workers ("tenants") it sent that
         prefix to. If the longest match covers more than 30% of the prompt (cache_threshold 0.3),
         the request goes to a tenant of the deepest matched node; else to the worker whose tree
         holds the fewest tokens (the one presumed to have the most free cache).
      3. Either way, the prompt is inserted into the tree under the chosen worker.
      4. Every 120 s, each tenant's part of the tree is trimmed to 2^26 tokens, least recently
         used leaves first.

    Departures, all forced by our interface: the tree is keyed by chained block hashes, so it
    matches whole blocks (SGLang's token tree matches page-aligned tokens, its string tree
    characters); among the tenants of the deepest node we take the most recently used (SGLang
    takes the first its map yields); ties in load or tree size break randomly.
    """

    name = "sglang"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5
    eviction_interval_s = 120.0
    max_tree_size = 1 << 26  # tokens per tenant

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cost_model, rng, clock)
        self._nodes: dict[BlockHash, _TreeNode] = {}
        self._tenant_to_tokens: dict[WorkerId, int] = {}
        self._last_eviction_s = clock()

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        now = self.clock()
        if now - self._last_eviction_s >= self.eviction_interval_s:
            self._evict(query.block_size)
            self._last_eviction_s = now
        loads = [w.num_running for w in workers]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            decision = self._pick_lowest(query, workers, [float(n) for n in loads])
        else:
            decision = self._pick_by_tree(query, workers)
        self._insert(query.block_hashes, decision.worker_id, query.block_size, now)
        return decision

    def tree_tokens(self, worker: WorkerId) -> int:
        """Tokens the tree attributes to `worker` (SGLang's per-tenant size)."""
        return self._tenant_to_tokens.get(worker, 0)

    def _pick_by_tree(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        live = {w.worker_id for w in workers}
        matched_blocks, tenant = self._prefix_match(query.block_hashes, live)
        matched_tokens = min(matched_blocks * query.block_size, query.prompt_len)
        if tenant is not None and matched_tokens / query.prompt_len > self.cache_threshold:
            costs = [0.0 if w.worker_id == tenant else 1.0 for w in workers]
        else:
            costs = [float(self._tenant_to_tokens.get(w.worker_id, 0)) for w in workers]
        return self._pick_lowest(query, workers, costs)

    def _prefix_match(
        self, hashes: Sequence[BlockHash], live: set[WorkerId]
    ) -> tuple[int, WorkerId | None]:
        depth, holders = 0, None
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                break
            held = {t: s for t, s in node.tenant_to_last_access.items() if t in live}
            if not held:
                break
            depth, holders = node.depth, held
        if holders is None:
            return 0, None
        return depth, max(holders, key=lambda t: holders[t])

    def _insert(
        self, hashes: Sequence[BlockHash], tenant: WorkerId, block_size: int, now: float
    ) -> None:
        added = 0
        for depth, h in enumerate(hashes, 1):
            node = self._nodes.get(h)
            if node is None:
                node = self._nodes[h] = _TreeNode(depth)
            if tenant not in node.tenant_to_last_access:
                added += block_size
            node.tenant_to_last_access[tenant] = now
        self._tenant_to_tokens[tenant] = self._tenant_to_tokens.get(tenant, 0) + added

    def _evict(self, block_size: int) -> None:
        for tenant, size in list(self._tenant_to_tokens.items()):
            if size <= self.max_tree_size:
                continue
            # Leaves first: a path is stamped whole on insert and an ancestor is touched whenever
            # a descendant is, so (oldest access, deepest) order never strands a descendant.
            owned = sorted(
                (node.tenant_to_last_access[tenant], -node.depth, h)
                for h, node in self._nodes.items()
                if tenant in node.tenant_to_last_access
            )
            for _, _, h in owned:
                if size <= self.max_tree_size:
                    break
                node = self._nodes[h]
                del node.tenant_to_last_access[tenant]
                if not node.tenant_to_last_access:
                    del self._nodes[h]
                size -= block_size
            self._tenant_to_tokens[tenant] = size


@dataclass(slots=True)
class _ActiveRequest:
    worker: WorkerId
    hashes: tuple[BlockHash, ...]
    has_tail: bool  # a partial last block, which no other request shares


class DynamoKvPolicy(RoutingPolicy):
    """Dynamo's KV router (`--router-mode kv`) with its defaults.

    As Dynamo's KV router does by default, each worker gets the logit

        logit(w) = overlap_score_weight * potential_prefill_blocks(w) + potential_active_blocks(w)

    with overlap_score_weight 1.0 and temperature 0 (the lowest logit wins, ties at random):

      * potential_prefill_blocks = (prefill tokens still queued on w + this prompt's tokens not
        covered by w's cached overlap) / block_size, the overlap read from the KV-event index;
      * potential_active_blocks = distinct blocks of the requests in flight on w (tracked by the
        router from routing to completion) + this prompt's blocks not already among them.

    The router counts a request's blocks as active from routing until `on_request_done`; its
    queued prefill tokens come from the load tracker. Departure: Dynamo also grows a request's
    active blocks as it decodes; our router hears of a request only at route, first token and end.
    """

    name = "dynamo"
    overlap_score_weight = 1.0
    max_tracked_requests = 100_000  # bounds memory if a caller never reports completions

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cost_model, rng, clock)
        self._active: OrderedDict[str, _ActiveRequest] = OrderedDict()
        self._worker_to_block_refs: dict[WorkerId, dict[BlockHash, int]] = {}
        self._worker_to_partial_blocks: dict[WorkerId, int] = {}

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        bs = query.block_size
        has_tail = query.prompt_len % bs != 0
        logits = []
        for w in workers:
            overlap = min(w.matched_blocks, len(query.block_hashes))
            prefill_tokens = w.queued_prefill_tokens + query.prompt_len - overlap * bs
            refs = self._worker_to_block_refs.get(w.worker_id, {})
            active = len(refs) + self._worker_to_partial_blocks.get(w.worker_id, 0)
            shared = 0
            for h in query.block_hashes:  # active blocks of one worker form prefix-closed chains
                if h not in refs:
                    break
                shared += 1
            new_blocks = len(query.block_hashes) - shared + has_tail
            logits.append(self.overlap_score_weight * prefill_tokens / bs + active + new_blocks)
        decision = self._pick_lowest(query, workers, logits)
        self._track(query, decision.worker_id, has_tail)
        return decision

    def on_request_done(self, request_id: str) -> None:
        request = self._active.pop(request_id, None)
        if request is not None:
            self._release(request)

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        for rid in [r for r, a in self._active.items() if a.worker == worker_id]:
            del self._active[rid]
        self._worker_to_block_refs.pop(worker_id, None)
        self._worker_to_partial_blocks.pop(worker_id, None)

    def active_blocks(self, worker: WorkerId) -> int:
        refs = self._worker_to_block_refs.get(worker, {})
        return len(refs) + self._worker_to_partial_blocks.get(worker, 0)

    def _track(self, query: RouteQuery, worker: WorkerId, has_tail: bool) -> None:
        if query.request_id in self._active:
            self.on_request_done(query.request_id)
        request = _ActiveRequest(worker, tuple(query.block_hashes), has_tail)
        refs = self._worker_to_block_refs.setdefault(worker, {})
        for h in request.hashes:
            refs[h] = refs.get(h, 0) + 1
        partial = self._worker_to_partial_blocks
        partial[worker] = partial.get(worker, 0) + has_tail
        self._active[query.request_id] = request
        if len(self._active) > self.max_tracked_requests:
            _, oldest = self._active.popitem(last=False)
            self._release(oldest)

    def _release(self, request: _ActiveRequest) -> None:
        if request.has_tail and request.worker in self._worker_to_partial_blocks:
            self._worker_to_partial_blocks[request.worker] -= 1
        refs = self._worker_to_block_refs.get(request.worker, {})
        for h in request.hashes:
            left = refs.get(h, 0) - 1
            if left > 0:
                refs[h] = left
            else:
                refs.pop(h, None)
