"""kvmesh's cost: routed-prefix memory, recent-load balance, pulls; and the helpers behind them."""

from __future__ import annotations

import random

import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.recent_load import RecentLoad
from kvmesh.coordinator.routing.routed_prefixes import RoutedPrefixes
from kvmesh.coordinator.routing.router import KvmeshPolicy, KvmeshWeights, RouteQuery, WorkerView
from kvmesh.proto.block_hash import BlockHash

CM = CostModel()
A, B = WorkerId("a"), WorkerId("b")


def hashes(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


def view(w: str, matched: int = 0, device: int | None = None, queued_ms: float = 0.0) -> WorkerView:
    d = matched if device is None else device
    return WorkerView(WorkerId(w), 1000, 1000, queued_ms, 0, 0, matched, d)


def query(rid: str, hs: list[BlockHash]) -> RouteQuery:
    return RouteQuery(rid, hs, 16 * len(hs) + 5, 16)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_routed_prefixes_extend_a_worker_until_done_or_expired() -> None:
    r = RoutedPrefixes(ttl_s=10.0)
    r.add("r1", A, hashes(1, 2, 3), now_s=0.0)
    r.add("r2", B, hashes(1, 2, 3, 4), now_s=1.0, start=2)  # the index shows b holding 1, 2
    chain = hashes(1, 2, 3, 4, 5)
    assert (r.extend(A, chain, 0), r.extend(B, chain, 2), r.extend(B, chain, 0)) == (3, 4, 0)
    assert r.extend(A, chain, 5) == 5  # already holds more than was routed
    r.check_invariants()
    r.discard("r1")
    assert r.extend(A, chain, 0) == 0 and r.extend(B, chain, 2) == 4
    r.expire(now_s=11.5)
    assert r.extend(B, chain, 2) == 2 and len(r) == 0
    r.check_invariants()


def test_routed_prefixes_stay_bounded() -> None:
    r = RoutedPrefixes(ttl_s=10.0, max_entries=2)
    for i in range(5):
        r.add(f"r{i}", A, hashes(i, 100 + i), now_s=0.0)
    assert len(r) == 2 and r.extend(A, hashes(0, 100), 0) == 0
    assert r.extend(A, hashes(4, 104), 0) == 2
    r.check_invariants()
    with pytest.raises(ValueError, match="ttl_s must be > 0, got 0"):
        RoutedPrefixes(ttl_s=0)


def test_recent_load_decays_exponentially() -> None:
    load = RecentLoad(horizon_s=10.0)
    load.add(A, 100.0, now_s=0.0)
    load.add(A, 100.0, now_s=0.0)
    assert load.num_requests(A, 0.0) == 2.0
    assert load.work_ms(A, 10.0) == pytest.approx(200.0 / 2.718281828, rel=1e-6)
    assert load.work_ms(B, 10.0) == 0.0
    with pytest.raises(ValueError, match="work_ms must be >= 0, got -1"):
        load.add(A, -1.0, 0.0)


def test_a_burst_sharing_a_new_prefix_lands_on_one_worker() -> None:
    # The index knows nothing yet; the policy remembers where it sent the first request.
    p = KvmeshPolicy(CM, random.Random(0), Clock())
    ws = [view("a"), view("b")]
    first = p.choose(query("r1", hashes(1, 2, 3, 4)), ws).worker_id
    assert all(
        p.choose(query(f"r{i}", hashes(1, 2, 3, 4, 10 + i)), ws).worker_id == first
        for i in range(2, 6)
    )


def test_routed_prefixes_are_forgotten_once_the_request_is_done() -> None:
    p = KvmeshPolicy(CM, random.Random(0), Clock(), KvmeshWeights(request_balance=0))
    first = p.choose(query("r1", hashes(1, 2, 3, 4)), [view("a"), view("b")])
    p.on_request_done("r1")
    other = "b" if first.worker_id == "a" else "a"
    # Now only the index counts: the other worker holds it.
    ws = [view(first.worker_id), view(other, matched=4)]
    assert p.choose(query("r2", hashes(1, 2, 3, 4)), ws).worker_id == other


def test_new_prefixes_avoid_the_worker_that_was_given_most_lately() -> None:
    clock = Clock()
    p = KvmeshPolicy(CM, random.Random(0), clock)
    ws = [view("a"), view("b", matched=40)]
    for i in range(5):  # b's prefix keeps b busy with cached follow-ups
        p.choose(RouteQuery(f"h{i}", hashes(*range(1, 41)), 16 * 40 + 5, 16), ws)
    fresh = p.choose(RouteQuery("new", hashes(900, 901), 37, 16), [view("a"), view("b")])
    assert fresh.worker_id == "a"


def test_pulls_are_planned_when_cheaper_than_recomputing() -> None:
    p = KvmeshPolicy(CM, random.Random(0), Clock())
    p.transfer_ms = lambda _src, _dst, num_tokens: 0.001 * num_tokens
    busy_holder = view("b", matched=8, queued_ms=500.0)
    d = p.choose(query("r1", hashes(*range(1, 9))), [view("a"), busy_holder])
    assert d.worker_id == "a" and d.pull is not None
    assert d.pull.source == "b" and d.pull.num_blocks == 8 and d.pull.from_block == 0


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError, match="recompute_weight must be >= 0, got -1"):
        KvmeshWeights(recompute_weight=-1)
    with pytest.raises(ValueError, match="balance_horizon_s must be > 0, got 0"):
        KvmeshWeights(balance_horizon_s=0)
