from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.load_tracker import LoadTracker
from kvmesh.coordinator.routing.policy import RouteQuery, WorkerView
from kvmesh.coordinator.routing.router import POLICIES, make_policy
from kvmesh.proto.block_hash import BlockHash

CM = CostModel()
HASHES = [BlockHash(i) for i in range(1, 9)]


def view(
    w: str, matched: int = 0, queued_ms: float = 0.0, running: int = 0, free: int = 1000
) -> WorkerView:
    return WorkerView(WorkerId(w), 1000, free, queued_ms, int(queued_ms), running, matched, matched)


def query(prompt_len: int = 130, session: str = "") -> RouteQuery:
    return RouteQuery("r", HASHES, prompt_len, 16, session)


def test_kvmesh_prefers_the_worker_holding_the_prefix() -> None:
    p = KvmeshPolicy(CM, random.Random(0))
    d = p.choose(query(), [view("w0"), view("w1", matched=8), view("w2", matched=2)])
    assert d.worker_id == "w1" and d.matched_blocks == 8


def test_kvmesh_leaves_a_hot_worker_when_its_queue_costs_more_than_recompute() -> None:
    # Fresh policies: a policy remembers where it sent a prompt (see test_kvmesh_policy.py).
    recompute_ms = CM.prefill_ms(130)
    busy = view("w1", matched=8, queued_ms=10 * recompute_ms)
    assert KvmeshPolicy(CM, random.Random(0)).choose(query(), [view("w0"), busy]).worker_id == "w0"
    light = view("w1", matched=8, queued_ms=0.1 * recompute_ms)
    assert KvmeshPolicy(CM, random.Random(0)).choose(query(), [view("w0"), light]).worker_id == "w1"


def test_ties_break_randomly_but_reproducibly() -> None:
    picks = {
        KvmeshPolicy(CM, random.Random(s)).choose(query(), [view("a"), view("b")]).worker_id
        for s in range(20)
    }
    assert picks == {"a", "b"}
    again = [
        KvmeshPolicy(CM, random.Random(3)).choose(query(), [view("a"), view("b")]).worker_id
        for _ in range(3)
    ]
    assert len(set(again)) == 1


def test_session_affinity_breaks_ties_toward_the_last_worker() -> None:
    p = KvmeshPolicy(CM, random.Random(1))
    first = p.choose(query(session="s"), [view("a"), view("b")]).worker_id
    for _ in range(10):
        assert p.choose(query(session="s"), [view("a"), view("b")]).worker_id == first


def test_round_robin_cycles() -> None:
    p = make_policy("round_robin", CM, random.Random(0))
    ws = [view("w0"), view("w1"), view("w2")]
    assert [p.choose(query(), ws).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_loaded_ignores_cache() -> None:
    p = make_policy("least_loaded", CM, random.Random(0))
    assert p.choose(query(), [view("w0", matched=8, queued_ms=5), view("w1")]).worker_id == "w1"


def test_session_sticky_keeps_a_session_on_one_worker() -> None:
    p = make_policy("session_sticky", CM, random.Random(0))
    first = p.choose(query(session="s"), [view("w0"), view("w1")]).worker_id
    other = "w1" if first == "w0" else "w0"
    loaded = [view(first, queued_ms=100), view(other)]
    assert p.choose(query(session="s"), loaded).worker_id == first


def test_every_policy_returns_a_given_worker() -> None:
    for name in POLICIES:
        p = make_policy(name, CM, random.Random(0))
        d = p.choose(query(), [view("x", matched=3)])
        assert d.worker_id == "x" and len(d.scores) == 1


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", CM, random.Random(0))


def test_cost_model_is_monotone_in_uncached_tokens() -> None:
    assert CM.prefill_ms(0) == 0
    assert CM.prefill_ms(100) < CM.prefill_ms(200) < CM.prefill_ms(200, 1000)
    with pytest.raises(ValueError):
        CostModel(prefill_per_token_ms=-1)


def test_cost_model_prices_each_row_as_prefill_ms_from_int_or_float_token_counts() -> None:
    new = [0, 1, 17, 512, 8191]
    cached = [0, 4096, 16, 0, 1]
    want = [CM.prefill_ms(n, c) for n, c in zip(new, cached, strict=True)]
    as_ints = CM.prefill_ms_array(np.array(new), np.array(cached))
    as_floats = CM.prefill_ms_array(np.array(new, dtype=np.float64), np.array(cached, float))
    assert as_ints.tolist() == want
    assert as_floats.tolist() == want  # bit for bit: whole numbers are exact as floats


def test_load_tracker_queues_until_prefilled_and_runs_until_finished() -> None:
    t = LoadTracker()
    w = WorkerId("w0")
    t.on_routed("a", w, 5.0, 100)
    t.on_routed("b", w, 3.0, 50)
    assert t.queued_prefill_ms(w) == 8.0 and t.num_running(w) == 2 and t.num_queued(w) == 2
    t.on_prefilled("a")
    t.on_prefilled("a")  # idempotent
    assert t.queued_prefill_ms(w) == 3.0 and t.num_queued(w) == 1
    assert list(t.num_queued_many([w, WorkerId("w1")])) == [1, 0]
    t.on_finished("b")
    t.on_finished("a")
    assert t.queued_prefill_ms(w) == 0.0 and t.num_running(w) == 0 and t.num_queued(w) == 0
    t.check_invariants()
    with pytest.raises(ValueError, match="already in flight"):
        t.on_routed("c", w, 1.0, 1)
        t.on_routed("c", w, 1.0, 1)


def test_session_map_is_bounded_and_forgets_dead_workers() -> None:
    from kvmesh.coordinator.routing.policy import SessionMap

    sessions = SessionMap(max_sessions=2)
    sessions.remember("a", WorkerId("w0"))
    sessions.remember("b", WorkerId("w1"))
    sessions.remember("a", WorkerId("w0"))  # refreshes a: b is now the oldest
    sessions.remember("c", WorkerId("w0"))
    assert len(sessions) == 2 and sessions.get("b") is None and sessions.get("a") == "w0"
    sessions.forget_worker(WorkerId("w0"))
    assert sessions.get("a") is None and sessions.get("c") is None
    sessions.remember("", WorkerId("w1"))  # no session: nothing remembered
    assert len(sessions) == 0


def test_session_map_is_bounded_in_bytes_whatever_the_session_ids() -> None:
    from kvmesh.coordinator.routing.policy import SessionMap

    overhead = SessionMap.ENTRY_OVERHEAD_BYTES
    sessions = SessionMap(max_sessions=1000, max_bytes=10 * (overhead + 1000))
    for k in range(50):
        sessions.remember(f"{k:04d}" + "x" * 996, WorkerId("w0"))  # 1000 bytes each
        sessions.check_invariants()
    assert len(sessions) == 10 and sessions.num_bytes == 10 * (overhead + 1000)
    assert sessions.get("0049" + "x" * 996) == "w0" and sessions.get("0039" + "x" * 996) is None
    sessions.remember("y" * 20_000, WorkerId("w1"))  # could never fit: ignored, nothing evicted
    assert len(sessions) == 10
    sessions.forget_worker(WorkerId("w0"))
    sessions.check_invariants()
    assert sessions.num_bytes == 0
