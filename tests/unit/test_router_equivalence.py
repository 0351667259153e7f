"""kvmesh's vectorised policy against its scalar reference: the same decisions on the same inputs.

`KvmeshPolicy` prices every worker at once over `WorkerColumns`; `KvmeshReferencePolicy` prices
one `WorkerView` at a time, as the router did before. Both are driven through the same long,
random sequence of routes (sessions, routed prefixes, pulls, memory pressure, small pools
full of reused prefixes, calibrated decode, answers of unknown, short and long length, requests
finishing, workers leaving, time passing), each fed the other's state changes only through its
own decisions; any term that drifts between them changes a decision or a cost (and a reference
without one of the terms is caught: the eviction, queue, memory and new-prefix terms' checks
below).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.kvmesh_reference import KvmeshReferencePolicy
from kvmesh.coordinator.routing.kvmesh_weights import KvmeshWeights
from kvmesh.coordinator.routing.policy import RouteDecision, RouteQuery, WorkerColumns, WorkerView
from kvmesh.coordinator.routing.pull_planner import PrefillOption
from kvmesh.proto.block_hash import BlockHash

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _fleet(
    rng: random.Random, num_workers: int, chain_len: int, held_share: float | None = None
) -> list[WorkerView]:
    """`held_share`: about the share of workers holding some of the chain (None: a quarter)."""
    views = []
    for w in range(num_workers):
        if held_share is None:
            matched = rng.choice([0, 0, 0, rng.randrange(chain_len + 1)])
        else:
            matched = rng.randrange(chain_len + 1) if rng.random() < held_share else 0
        device = rng.choice([matched, rng.randrange(matched + 1)])
        running = rng.choice([0, rng.randrange(40)])
        queued = rng.choice([0.0, 0.0, rng.random() * 200])
        # Small pools too: there the prefixes reused lately fill much of the pool.
        num_blocks = rng.choice([100_000, rng.randrange(64, 1024)])
        free = rng.choice([num_blocks, rng.randrange(64)])
        num_queued = rng.choice([0, 0, rng.randrange(1, 12)])
        views.append(
            WorkerView(
                WorkerId(f"w{w:04d}"),
                num_blocks,
                free,
                queued,
                int(queued),
                running,
                matched,
                device,
                num_queued,
            )
        )
    return views


def _same(fast: RouteDecision, ref: RouteDecision) -> None:
    assert fast.worker_id == ref.worker_id
    assert fast.matched_blocks == ref.matched_blocks
    assert fast.cost_ms == pytest.approx(ref.cost_ms, rel=1e-12, abs=1e-12)
    assert fast.predicted_prefill_ms == pytest.approx(ref.predicted_prefill_ms, rel=1e-12)
    assert fast.pull == ref.pull or (
        fast.pull is not None
        and ref.pull is not None
        and replace(fast.pull, transfer_ms=0.0) == replace(ref.pull, transfer_ms=0.0)
        and fast.pull.transfer_ms == pytest.approx(ref.pull.transfer_ms, rel=1e-12)
    )
    assert (fast.session_worker_id, fast.session_affinity_ms) == (
        ref.session_worker_id,
        ref.session_affinity_ms,
    )
    assert len(fast.scores) == len(ref.scores)
    for f, r in zip(fast.scores, ref.scores, strict=True):
        assert (f.worker_id, f.matched_blocks) == (r.worker_id, r.matched_blocks)
        assert f.cost_ms == pytest.approx(r.cost_ms, rel=1e-12, abs=1e-9)


class _ReferenceWithoutEviction(KvmeshReferencePolicy):
    """The reference with one term dropped: the drive below must tell it apart."""

    def _eviction_ms(self, query: RouteQuery, w: WorkerView, stored: int) -> float:
        return 0.0


class _ReferenceWithoutQueueSteps(KvmeshReferencePolicy):
    """The reference blind to the steps a worker's queued prefills run (each carries its batch)."""

    def _scalar_costs(
        self,
        query: RouteQuery,
        views: Sequence[WorkerView],
        options: Sequence[PrefillOption],
        now: float,
        indexed: Sequence[WorkerView],
    ) -> list[float]:
        views = [w._replace(num_queued=0) for w in views]
        return super()._scalar_costs(query, views, options, now, indexed)


class _ReferenceWithoutMemory(KvmeshReferencePolicy):
    """The reference that holds KV blocks for free."""

    def _memory_ms(self, query: RouteQuery, w: WorkerView, stored: int, step_ms: float) -> float:
        return 0.0


class _ReferenceWithoutNewPrefixBalance(KvmeshReferencePolicy):
    """The reference that places a prompt nobody holds by load alone."""

    def _new_prefix_counts(
        self, query: RouteQuery, views: Sequence[WorkerView], now: float
    ) -> list[float] | None:
        return None


class _ReferenceWithSquaredStore(KvmeshReferencePolicy):
    """The reference that prices the prompt blocks a request stores as its answer's: by the
    square of the pool's share in use (the memory term before the stored blocks went linear)."""

    def _memory_ms(self, query: RouteQuery, w: WorkerView, stored: int, step_ms: float) -> float:
        weights = self.weights
        answer_len = weights.answer_tokens_for(query.max_tokens)
        pool = max(w.num_blocks, 1)
        in_use = 1.0 - w.num_free_blocks / pool
        held_ms = (stored + answer_len / query.block_size) / pool * answer_len * step_ms
        return weights.memory_weight * held_ms * (in_use * in_use)


def _drive(
    seed: int,
    num_workers: int,
    pulls: bool,
    kv_calibrated: bool,
    reference: type[KvmeshReferencePolicy] = KvmeshReferencePolicy,
    uniform_pulls: bool = False,
    held_share: float | None = None,
) -> None:
    rng = random.Random(seed)
    cm = CostModel(decode_per_kv_token_ms=1e-5 if kv_calibrated else 0.0)
    weights = KvmeshWeights(routed_prefix_ttl_s=5.0, session_affinity_blocks=2.0)
    clock = Clock()
    fast = KvmeshPolicy(cm, random.Random(seed), clock, weights)
    ref = reference(cm, random.Random(seed), clock, weights)
    if pulls and uniform_pulls:  # a price of the tokens alone: priced once per distinct match
        for p in (fast, ref):
            p.transfer_ms = lambda src, dst, num_tokens: 0.5 + num_tokens * 3e-4
        fast.transfer_ms_uniform = True
    elif pulls:
        for p in (fast, ref):
            p.transfer_ms = lambda src, dst, num_tokens: (
                0.5 + (len(src) + len(dst)) * num_tokens * 1e-4
            )
    families = [[BlockHash(f * 1000 + i + 1) for i in range(40)] for f in range(6)]
    in_flight: list[str] = []
    for step in range(300):
        clock.now_s += rng.choice([0.0, 0.01, 0.3, 2.0])
        if rng.random() < 0.15:  # a prompt nobody holds: the new-prefix balance prices it
            chain = [BlockHash(10_000 * (step + 1) + i) for i in range(rng.randrange(1, 41))]
        else:
            chain = rng.choice(families)[: rng.randrange(1, 41)]
        prompt_len = len(chain) * BS + rng.randrange(BS)
        session = rng.choice(["", "", "s1", "s2", f"s{step}"])
        max_tokens = rng.choice([None, rng.randrange(1, 64), rng.randrange(64, 4096)])
        query = RouteQuery(f"r{step}", chain, prompt_len, BS, session, max_tokens)
        views = _fleet(rng, num_workers, len(chain), held_share)
        if chain[0] >= 10_000:
            views = [v._replace(matched_blocks=0, matched_device_blocks=0) for v in views]
        if rng.random() < 0.2:  # every worker alike: the tie-break must draw the same
            views = [views[0]._replace(worker_id=v.worker_id) for v in views]
        d_fast = fast.choose(query, WorkerColumns.from_views(views))
        d_ref = ref.choose(query, views)
        _same(d_fast, d_ref)
        in_flight.append(query.request_id)
        if rng.random() < 0.3:
            done = in_flight.pop(rng.randrange(len(in_flight)))
            fast.on_request_done(done)
            ref.on_request_done(done)
        if rng.random() < 0.02:
            gone = rng.choice(views).worker_id
            fast.on_worker_removed(gone)
            ref.on_worker_removed(gone)


@pytest.mark.parametrize(
    ("seed", "num_workers", "pulls", "kv_calibrated"),
    [(0, 3, False, False), (1, 17, True, False), (2, 64, True, True), (3, 256, False, True)],
)
def test_vectorised_policy_decides_as_the_scalar_reference(
    seed: int, num_workers: int, pulls: bool, kv_calibrated: bool
) -> None:
    _drive(seed, num_workers, pulls, kv_calibrated)


@pytest.mark.parametrize(
    ("seed", "num_workers", "held_share"),
    [(4, 3, 0.25), (5, 40, 0.25), (6, 64, 0.06), (7, 256, 0.03)],
)
def test_pulls_priced_by_their_tokens_alone_decide_as_the_scalar_reference(
    seed: int, num_workers: int, held_share: float
) -> None:
    # (few holders: the options are priced per distinct match; more: in arrays, as elsewhere)
    _drive(seed, num_workers, True, True, uniform_pulls=True, held_share=held_share)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_drive_catches_a_reference_that_ignores_evictions(seed: int) -> None:
    with pytest.raises(AssertionError):
        _drive(seed, 17, seed % 2 == 1, seed >= 2, _ReferenceWithoutEviction)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "reference",
    [
        _ReferenceWithoutQueueSteps,
        _ReferenceWithoutMemory,
        _ReferenceWithoutNewPrefixBalance,
        _ReferenceWithSquaredStore,
    ],
)
def test_the_drive_catches_a_reference_without_a_queue_memory_or_new_prefix_term(
    seed: int, reference: type[KvmeshReferencePolicy]
) -> None:
    with pytest.raises(AssertionError):
        _drive(seed, 17, seed % 2 == 1, seed >= 2, reference)


def test_columns_read_back_as_the_views_they_were_built_from() -> None:
    views = _fleet(random.Random(5), 9, 12)
    cols = WorkerColumns.from_views(views)
    assert list(cols) == views and cols[3] == views[3] and cols[2:4] == views[2:4]
    assert cols.index_of[views[7].worker_id] == 7
