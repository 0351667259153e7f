"""kvmesh's routing policy: one continuous cost per worker, every worker priced at once.

The terms are listed in `KvmeshPolicy`'s docstring; their knobs are `KvmeshWeights`; the scalar
reference that a test holds this class to is `kvmesh_reference.KvmeshReferencePolicy`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, overload

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_weights import KvmeshWeights
from kvmesh.coordinator.routing.load_terms import LoadTermCache
from kvmesh.coordinator.routing.policy import (
    _TIE_EPSILON_MS,
    RouteDecision,
    RouteQuery,
    RoutingPolicy,
    ScoreColumns,
    SessionMap,
    WorkerColumns,
    WorkerView,
)
from kvmesh.coordinator.routing.pull_planner import PullPlan
from kvmesh.coordinator.routing.recent_load import RecentLoad
from kvmesh.coordinator.routing.reused_prefixes import ReusedPrefixes
from kvmesh.coordinator.routing.routed_prefixes import RoutedPrefixes
from kvmesh.coordinator.routing.running_context import RunningContext
from kvmesh.proto.block_hash import BlockHash, num_reusable_blocks, num_reusable_tokens
from kvmesh.proto.placements import Placement


class _Rows(Sequence[WorkerId]):
    """`ids[r] for r in rows`, read only when indexed (a pricer that ignores the targets, as the
    simulator's does, never pays for the list)."""

    def __init__(self, ids: Sequence[WorkerId], rows: np.ndarray) -> None:
        self._ids, self._rows = ids, rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> WorkerId: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerId]: ...
    def __getitem__(self, i: int | slice) -> WorkerId | list[WorkerId]:
        if isinstance(i, slice):
            return [self._ids[r] for r in self._rows[i].tolist()]
        return self._ids[int(self._rows[i])]


_FEW_HELD_ROWS = 16
_FEW_HELD_SHARE = 8
"""Up to `_FEW_HELD_ROWS` rows holding some of the prompt, and at most one row in
`_FEW_HELD_SHARE`, with pulls priced by their tokens alone, the prefill options are
priced per distinct match (`KvmeshPolicy._options_few`), not for every row. (A small fleet
whose rows mostly hold the prompt prices faster in arrays: 16 of 16 rows took ~40 us in scalars,
~20 us in arrays.)"""


class _PrefillOptions(NamedTuple):
    """Per row: when the prompt's KV is ready on the worker, and how (see `_prefill_options`)."""

    ready_ms: np.ndarray
    """Transfer + prefill of the cheaper option."""
    recompute_ms: np.ndarray
    """The prefill part of it."""
    cached_tokens: np.ndarray
    """Prompt tokens the worker holds (reusable: the last one is always computed), as float64
    whole numbers."""
    pulled: np.ndarray | None = None
    """True where pulling from `peer` first is the cheaper option (None: no row pulls)."""
    link_ms: np.ndarray | None = None
    """The pull's transfer time where `pulled`, else 0."""
    peer: int | None = None
    """Row of the worker the pulls come from."""


class KvmeshPolicy(RoutingPolicy):
    """One continuous cost per worker, in milliseconds; the lowest wins, ties break randomly.

        cost(w) = queue(w)                 prefill work routed to w and not yet done
                + ready(w)                 prefill of what w lacks (after a pull, when cheaper)
                + r * recompute(w)         that recompute again, as work taken from later requests
                + decode_step(w)           the running batch rides along the prefill
                + queued(w) * step(w)      each prefill queued at w runs at least one step,
                                           which carries w's batch and the KV it reads
                + decode_batch(w)          2 * tokens * (step_load(w) - least step_load),
                                           tokens: a share of the request's max_tokens
                + m * (stored(w) * in_use(w) + answer_blocks * in_use(w)^2)
                    / pool(w) * answer * step(w)
                                           the blocks the request holds on w (prompt it lacks
                                           + answer) for its answer's steps, where w's pool is
                                           in use: what later requests at w wait for them
                + e * stored(w) * block_prefill * reused_share(w)
                                           what the prompt's new blocks displace on w
                + p * recent_work(w) * uncached_share(w)
                + q * recent_requests(w) * min over workers of ready
                + g * recent_new_prefixes(w) * min over workers of ready
                                           only for a prompt no worker holds any of
                - session_affinity(w)     a blocks' prefill, on the session's last worker

    (recent_* are measured above the least-loaded worker's, so only differences count;
    recent_new_prefixes counts the prompts w was given from scratch.) Every
    block a worker stores for the prompt (whatever it lacks on its device, computed or pulled)
    displaces one of its pool, sooner if the pool is full, once it fills if not: priced as that
    block's prefill times the share of w's pool the prefixes reused on w lately fill
    (`ReusedPrefixes`, at most 1), so a copy made for balance pays for the prefixes it pushes
    out where the pool is short, and barely where the pool holds more than its traffic reuses
    (`KvmeshWeights.eviction_weight`). Free blocks do not exempt a copy: a pool's empty blocks
    are a warm-up transient, and copies made into them are what spread prefixes over pools
    they later overflow (docs/benchmarks.md, "copies priced by what they displace"). A worker
    that holds more of the prompt saves prefill and recompute; a busy one pays its queue. Nothing
    switches at a threshold: a cached prefix wins until the queue it builds costs more than
    recomputing twice, and a hot prefix's holder keeps its followers only until the decode batch
    they build there costs more than pulling (or recomputing) the prefix on a quieter worker:
    the prefix is replicated as soon as, and only as far as, balance asks. The index only learns
    of a prefix once its prefill is done, so prompts routed in the last `routed_prefix_ttl_s`
    count as held by their worker (`RoutedPrefixes`): a burst sharing a new prefix lands together
    instead of being recomputed everywhere. A worker whose pool is full admits the next request
    only as its running sequences finish and free their blocks, so KV held is time taken from
    the requests after it there: a request is charged the share of w's pool it will hold
    (what it stores of the prompt, and its answer) over its answer's steps of w's batch: the
    answer's blocks times the square of the share of the pool in use, since they leave with the
    answer and delay others only where the pool is full now; the stored prompt blocks times the
    share itself, since they stay as long as the prompt's followers come and a pool in use now
    fills with them (`KvmeshWeights.memory_weight`). Where pools run full, a follower that joins
    a hot prefix's holder holds its question and answer, one that copies the prefix holds the
    prefix as well, and a long answer holds either ~25 times as long as a short one: copies and
    long answers go where memory is free, short hits stay with their cache. Where pools are
    mostly free the answer's part fades and a copy still pays for part of what it keeps
    (docs/benchmarks.md, "memory held" and "new prompts dealt evenly"). A prompt no worker
    holds any of goes to the worker given the fewest prompts from scratch lately, each such
    prompt counted as this one's cheapest prefill times `KvmeshWeights.new_prefix_balance`:
    equally hot new prefixes are dealt out evenly, as a tree router deals its groups, whatever
    the queues of the moment.
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
        self._reused = ReusedPrefixes(self.weights.balance_horizon_s)
        # Only the request counts are read: prompts placed on a worker that held none of them.
        self._new_prefixes = RecentLoad(self.weights.balance_horizon_s)
        self._load_terms = LoadTermCache()
        # The eviction term's share of each pool the reused prefixes fill, with the sums and
        # the pools it was priced from (kept while both are the same arrays).
        self._reused_share: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    replicable = True

    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        decision, now = self._propose(query, workers)
        self._remember(query, decision, decision.indexed_blocks, now)
        return decision

    def propose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        return self._propose(query, workers)[0]

    def place(
        self, placement: Placement, now_s: float, new_hash_array: np.ndarray | None = None
    ) -> None:
        """What `choose` remembers of its own decision, from a committed log entry.
        `new_hash_array`: `placement.new_hashes` as a uint64 array, when the caller has it."""
        worker = WorkerId(placement.worker_id)
        self._routed.add(
            placement.request_id, worker, placement.new_hashes, now_s, hash_array=new_hash_array
        )
        self._recent.add(worker, placement.predicted_prefill_ms, now_s)
        self._running.add(placement.request_id, worker, placement.prompt_len, now_s)
        self._sessions.remember(placement.session_id, worker)
        if placement.num_reused_blocks:
            self._reused.add(worker, placement.last_reused_hash, placement.num_reused_blocks, now_s)
        elif placement.new_hashes:
            self._new_prefixes.add(worker, 0.0, now_s)

    def _propose(
        self, query: RouteQuery, workers: Sequence[WorkerView]
    ) -> tuple[RouteDecision, float]:
        """The decision and the time it was priced at, remembering nothing."""
        if not workers:
            raise ValueError("no workers to route to")
        cols = WorkerColumns.from_views(workers)
        now = self.clock()
        self._routed.expire(now)
        self._running.expire(now)
        self._reused.expire(now)
        matched = cols.matched_blocks
        if len(self._routed):
            # Only the local match grows: a routed prefix is not yet there for a peer to pull.
            matched = self._routed.extend_many(
                cols.index_of, query.block_hashes, matched, query.block_hash_array
            )
        options = self._prefill_options(query, cols, matched)
        costs = self._costs(query, cols, matched, options, now)
        i = self._lowest(costs)
        n, bs = query.prompt_len, query.block_size
        cached = num_reusable_tokens(n, int(matched[i]), bs)
        predicted_ms = self.cost_model.prefill_ms(n - cached, cached)
        pull = None
        if options.pulled is not None and options.pulled[i]:
            assert options.peer is not None and options.link_ms is not None
            pull = PullPlan(
                cols.ids[options.peer],
                int(cols.matched_device_blocks[options.peer]),
                int(matched[i]),
                float(options.link_ms[i]),
            )
            predicted_ms = float(options.ready_ms[i])
        sticky = self._sessions.get(query.session_id)
        decision = RouteDecision(  # built once: `dataclasses.replace` costs microseconds
            cols.ids[i],
            int(matched[i]),
            float(costs[i]),
            predicted_ms,
            ScoreColumns(cols.ids, matched, costs),
            pull,
            sticky or "",
            0.0 if sticky is None else self._session_affinity_ms(query),
            int(cols.matched_blocks[i]),
        )
        return decision, now

    def _lowest(self, costs: np.ndarray) -> int:
        """The row of the lowest cost; ties (within `_TIE_EPSILON_MS`) broken by the rng, drawing
        as `RoutingPolicy._pick_lowest` does."""
        i = int(costs.argmin())
        tied = costs <= costs.item(i) + _TIE_EPSILON_MS
        if np.count_nonzero(tied) == 1:  # the lowest alone: no draw
            return i
        return int(self.rng.choice(tied.nonzero()[0].tolist()))

    def _prefill_options(
        self, query: RouteQuery, cols: WorkerColumns, matched: np.ndarray
    ) -> _PrefillOptions:
        """`pull_planner.cheapest_prefill` for every row: recompute what the worker lacks, or
        pull the longest device prefix a peer holds first, whichever is ready sooner."""
        cm, n, bs = self.cost_model, query.prompt_len, query.block_size
        if self.transfer_ms_uniform:
            if np.count_nonzero(matched) <= min(_FEW_HELD_ROWS, len(matched) // _FEW_HELD_SHARE):
                return self._options_few(query, cols, matched, matched.nonzero()[0])
        # (as float64 from the start: whole numbers, exact, so every price below is the same as
        # from int64 counts, without a conversion in each operation)
        cached = np.minimum(matched, float(num_reusable_blocks(n, bs)))
        cached *= bs
        recompute = cm.prefill_ms_array(n - cached, cached)
        device = cols.matched_device_blocks
        peer = int(device.argmax()) if self.transfer_ms is not None else -1
        if peer < 0 or device[peer] <= 0:
            return _PrefillOptions(recompute, recompute, cached)
        num_blocks = int(device[peer])
        # Never the peer itself: its match (any tier) is at least its device match.
        candidates = (num_blocks > matched).nonzero()[0]
        if not len(candidates):
            return _PrefillOptions(recompute, recompute, cached)
        moved_tokens = (num_blocks - matched[candidates]) * bs
        link = self._transfer_ms_many(cols.ids[peer], cols.ids, candidates, moved_tokens)
        pulled_cached = num_reusable_tokens(n, num_blocks, bs)
        with_pull = link + cm.prefill_ms(n - pulled_cached, pulled_cached)
        wins = with_pull < recompute[candidates]
        rows = candidates[wins]
        if not len(rows):
            return _PrefillOptions(recompute, recompute, cached)
        pulled = np.zeros(len(cols), dtype=bool)
        pulled[rows] = True
        link_ms = np.zeros(len(cols))
        link_ms[rows] = link[wins]
        ready = recompute.copy()
        ready[rows] = with_pull[wins]
        return _PrefillOptions(ready, ready - link_ms, cached, pulled, link_ms, peer)

    def _options_few(
        self, query: RouteQuery, cols: WorkerColumns, matched: np.ndarray, held_rows: np.ndarray
    ) -> _PrefillOptions:
        """`_prefill_options` where few rows hold any of the prompt (`held_rows`) and a pull's
        price depends on its tokens alone (`transfer_ms_uniform`): every option priced once for
        the rows holding nothing and once per distinct match, in scalars, where the whole
        fleet's arrays cost ~25 operations. `prefill_ms` is `prefill_ms_array` row by row, bit
        for bit (its contract), and a scalar price the vector one's: the same options."""
        cm, n, bs = self.cost_model, query.prompt_len, query.block_size
        device = cols.matched_device_blocks
        peer = int(device.argmax()) if self.transfer_ms is not None else -1
        num_blocks = int(device[peer]) if peer >= 0 else 0
        price = self.transfer_ms
        reusable = num_reusable_blocks(n, bs)
        with_pull_prefill = 0.0
        if num_blocks > 0:
            pulled_cached = num_reusable_tokens(n, num_blocks, bs)
            with_pull_prefill = cm.prefill_ms(n - pulled_cached, pulled_cached)

        def option(m: int, target: WorkerId) -> tuple[float, float, float, float, bool]:
            num_cached = float(min(m, reusable) * bs)
            recompute = cm.prefill_ms(n - num_cached, num_cached)
            if num_blocks > m:
                assert price is not None
                link = price(cols.ids[peer], target, (num_blocks - m) * bs)
                with_pull = link + with_pull_prefill
                if with_pull < recompute:
                    return num_cached, with_pull, with_pull - link, link, True
            return num_cached, recompute, recompute, 0.0, False

        num_rows = len(matched)
        base = option(0, cols.ids[0])
        # (`np.empty` and the array's own `fill`: `np.full` is a Python function around them)
        cached, ready, recompute_ms = np.empty(num_rows), np.empty(num_rows), np.empty(num_rows)
        link_ms, pulled = np.empty(num_rows), np.empty(num_rows, dtype=bool)
        cached.fill(base[0])
        ready.fill(base[1])
        recompute_ms.fill(base[2])
        link_ms.fill(base[3])
        pulled.fill(base[4])
        option_of: dict[int, tuple[float, float, float, float, bool]] = {}
        for row in held_rows.tolist():
            m = matched.item(row)
            o = option_of.get(m)
            if o is None:
                o = option_of[m] = option(m, cols.ids[row])
            cached[row], ready[row], recompute_ms[row], link_ms[row], pulled[row] = o
        if not np.count_nonzero(pulled):
            return _PrefillOptions(ready, ready, cached)
        return _PrefillOptions(ready, recompute_ms, cached, pulled, link_ms, peer)

    def _transfer_ms_many(
        self,
        source: WorkerId,
        ids: Sequence[WorkerId],
        rows: np.ndarray,
        num_tokens: np.ndarray,
    ) -> np.ndarray:
        targets = _Rows(ids, rows)
        if self.transfer_ms_many is not None:
            return np.asarray(self.transfer_ms_many(source, targets, num_tokens), np.float64)
        price = self.transfer_ms
        assert price is not None
        return np.array(
            [price(source, t, k) for t, k in zip(targets, num_tokens.tolist(), strict=True)],
            dtype=np.float64,
        )

    def _costs(
        self,
        query: RouteQuery,
        cols: WorkerColumns,
        matched: np.ndarray,
        options: _PrefillOptions,
        now: float,
    ) -> np.ndarray:
        """Every row's cost at once. Each term is `KvmeshReferencePolicy._scalar_costs`'s, with
        its operations in the same order, so the costs agree bit for bit (but for numpy's exp in
        the recent-load decay); change a term there first, then here."""
        cm, weights = self.cost_model, self.weights
        n, bs = query.prompt_len, query.block_size
        work, requests = self._recent.snapshot_arrays(cols.ids, now)
        # (kept while their columns are the same: `LoadTermCache`)
        steps = self._load_terms.steps(cols, cm)
        step_ms = steps.step_ms
        # Decode is paid per token, by this request and by every sequence it joins, over as many
        # tokens as its answer asks (`KvmeshWeights.decode_tokens_for`): what a hot prefix's
        # holder's growing batch costs a long answer, and barely costs a short one.
        calibrated = cm.decode_per_kv_token_ms > 0
        step_load: np.ndarray = steps.per_seq_ms
        if calibrated:
            step_load = self._running.tokens_many(cols.ids) * cm.decode_per_kv_token_ms
        # Below, a term that is 0 on every row is skipped and a weight of 1 not multiplied: a
        # cost is never -0.0, so adding +0.0 or multiplying by 1 would leave its bits as they
        # are (the reference's costs, bit for bit). In-place sums round as `cost = cost + x`.
        cost = cols.queued_prefill_ms + options.ready_ms
        if weights.recompute_weight == 1.0:
            cost += options.recompute_ms
        else:
            cost += weights.recompute_weight * options.recompute_ms
        if steps.running_rows is None:
            cost += step_ms
        else:  # adding only where w runs a batch: elsewhere the cost stays as `+ 0.0` leaves it
            np.add(cost, step_ms, out=cost, where=steps.running_rows)
        # Each prefill queued ahead runs at least one step, and the step carries w's batch (its
        # KV read too): a queue of cheap cache hits is as long in steps as in prefill.
        step_kv_ms = step_ms + step_load if calibrated else step_ms
        if np.count_nonzero(cols.num_queued):
            cost += cols.num_queued * step_kv_ms
        decode_tokens = weights.decode_tokens_for(query.max_tokens)
        if steps.decode_spread_ms is not None:  # (step_load above its least)
            cost += 2.0 * decode_tokens * steps.decode_spread_ms
        else:
            cost += 2.0 * decode_tokens * (step_load - step_load[step_load.argmin()])
        # What w lacks of the prompt on its device is stored there, computed or pulled (a prefix
        # routed to w and not yet indexed will be there: not stored).
        held = cols.matched_device_blocks
        if matched is not cols.matched_blocks:
            held = np.where(matched > cols.matched_blocks, matched, held)
        # (as floats: the maximum with 0.0 makes them, exactly, and the products below take
        # them without converting an int64 operand each)
        stored = np.maximum(query.num_prompt_blocks - held, 0.0)
        pools = self._load_terms.pool(cols)
        pool = pools.pool  # (num_blocks as floats, at least 1)
        if weights.memory_weight > 0:
            # The request holds what it stores and its answer's blocks for its answer's steps;
            # where w's pool is in use (`pools.in_use`), the requests after it at w wait for them.
            answer_len = weights.answer_tokens_for(query.max_tokens)
            # The prompt blocks it stores stay as long as their followers come, so they are
            # priced by the share in use (a pool in use now fills with them); the answer's leave
            # with it, so where the pool is full now: the square.
            held_ms = stored * pools.in_use
            held_ms += answer_len / bs * pools.in_use_squared
            held_ms /= pool
            held_ms *= answer_len
            held_ms *= step_kv_ms
            held_ms *= weights.memory_weight
            cost += held_ms
        if weights.eviction_weight > 0 and len(self._reused):
            # The stored blocks displace as much of w's pool; so much of that was reused lately
            # as w's reused prefixes fill of the pool.
            reused = self._reused.num_blocks_many(cols.ids)  # (the same array while unchanged)
            kept = self._reused_share
            if kept is not None and kept[0] is reused and kept[1] is pool:
                share = kept[2]
            else:
                share = np.minimum(1.0, reused / pool)
                self._reused_share = (reused, pool, share)
            block_ms = weights.eviction_weight * (cm.prefill_per_token_ms * bs)
            cost += block_ms * stored * share
        uncached_share = 1.0 - options.cached_tokens / n
        # Recent work and requests above the least worker's (each row's least read at its
        # `argmin`: the same value as `min`'s, without a reduction's set-up, ~1.5 us a row).
        work -= work[work.argmin()]
        requests -= requests[requests.argmin()]
        cost += weights.placement_balance * work * uncached_share
        cheapest_ready = options.ready_ms[options.ready_ms.argmin()]
        cost += weights.request_balance * requests * cheapest_ready
        if weights.new_prefix_balance > 0 and query.block_hashes and not np.count_nonzero(matched):
            # A prefix nobody holds: deal it to the worker given the fewest new prefixes lately
            # (each brings its followers), whatever the load of the moment says.
            placed = self._new_prefixes.snapshot_arrays(cols.ids, now)[1]
            new = weights.new_prefix_balance * (placed - placed[placed.argmin()])
            cost += new * cheapest_ready
        sticky = self._sessions.get(query.session_id)
        row = cols.index_of.get(sticky) if sticky is not None else None
        if row is not None:
            cost[row] -= self._session_affinity_ms(query)
        return cost

    def _session_affinity_ms(self, query: RouteQuery) -> float:
        blocks = self.weights.session_affinity_blocks
        return blocks * self.cost_model.prefill_per_token_ms * query.block_size

    def _remember(
        self, query: RouteQuery, decision: RouteDecision, indexed: int, now: float
    ) -> None:
        """`indexed`: the chosen worker's match in the index, before routed prefixes. What is
        remembered is the decision's placement, as a replica applies it from the decision log:
        one path, so `choose` is `propose` + `place` by construction."""
        hash_array = query.block_hash_array
        self.place(
            self.placement_of(query, decision, indexed),
            now,
            None if hash_array is None else hash_array[indexed:],
        )

    def placement_of(
        self, query: RouteQuery, decision: RouteDecision, indexed: int, origin: str = ""
    ) -> Placement:
        """The decision as the decision log carries it (`indexed`: as for `_remember`)."""
        n, hashes = query.prompt_len, query.block_hashes
        reused = decision.pull.num_blocks if decision.pull is not None else decision.matched_blocks
        return Placement(
            query.request_id,
            origin,
            decision.worker_id,
            query.session_id,
            n,
            n - num_reusable_tokens(n, reused, query.block_size),
            decision.predicted_prefill_ms,
            tuple(hashes[indexed:]),
            reused,
            hashes[reused - 1] if reused else BlockHash(0),
        )

    def on_request_done(self, request_id: str) -> None:
        self._routed.discard(request_id)
        self._running.discard(request_id)

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        self._sessions.forget_worker(worker_id)
        self._routed.forget_worker(worker_id)
        self._recent.forget(worker_id)
        self._running.forget_worker(worker_id)
        self._reused.forget_worker(worker_id)
        self._new_prefixes.forget(worker_id)
