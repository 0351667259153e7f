"""kvmesh's cost: routed-prefix memory, recent-load balance, pulls; and the helpers behind them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.kvmesh_reference import KvmeshReferencePolicy
from kvmesh.coordinator.routing.kvmesh_weights import KvmeshWeights
from kvmesh.coordinator.routing.policy import RouteDecision, RouteQuery, WorkerView
from kvmesh.coordinator.routing.recent_load import RecentLoad
from kvmesh.coordinator.routing.reused_prefixes import ReusedPrefixes
from kvmesh.coordinator.routing.routed_prefixes import RoutedPrefixes
from kvmesh.coordinator.routing.running_context import RunningContext
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


def test_routed_prefixes_extend_a_fleet_alike_with_the_chain_as_an_array() -> None:
    """`extend_many` reads the chain's hashes from its uint64 array when it has one: the same
    rows grow as far as `extend` says, with the array or without."""
    import numpy as np

    r = RoutedPrefixes(ttl_s=10.0)
    chain = hashes(*range(1, 61))
    r.add("r1", A, chain[:50], now_s=0.0, start=10)
    r.add("r2", B, chain, now_s=0.0, start=30)
    fleet = {WorkerId(f"w{i}"): i for i in range(12)} | {A: 12, B: 13}
    held = np.array([*range(0, 60, 5), 10, 30], dtype=np.int64)
    expected = [*held[:12].tolist(), r.extend(A, chain, 10), r.extend(B, chain, 30)]
    assert expected[12:] == [50, 60]
    array = np.array(chain, dtype=np.uint64)
    assert r.extend_many(fleet, chain, held).tolist() == expected
    assert r.extend_many(fleet, chain, held, array).tolist() == expected
    assert r.extend(A, chain, 10, array) == 50 and held.tolist()[12:] == [10, 30]


@pytest.mark.parametrize("screen_slots", [1, 16, 1 << 18])
def test_routed_prefixes_screen_rules_out_only_hashes_nobody_was_routed(screen_slots: int) -> None:
    """With the chain's array, `extend_many` looks up only the matches its screen cannot rule
    out: every row still grows as `extend` says, while routes are added, shared, done, expired,
    bounded and their workers removed (a screen of one slot rules nothing out; of 16, hashes
    share slots)."""
    import numpy as np

    rng = random.Random(screen_slots)
    r = RoutedPrefixes(ttl_s=10.0, max_entries=40, screen_slots=screen_slots)
    workers = [WorkerId(f"w{i}") for i in range(6)]
    fleet = {w: i for i, w in enumerate(workers)}
    families = [hashes(*range(f * 1000, f * 1000 + 60)) for f in range(5)]
    now_s, num_grown = 0.0, 0
    for i in range(400):
        chain = families[rng.randrange(len(families))][: rng.randrange(1, 61)]
        op = rng.random()
        if op < 0.6:
            start = rng.randrange(len(chain) + 1)
            # (every other run from the chain's array, copied, not converted: the same run)
            array = np.array(chain, dtype=np.uint64) if i % 2 else None
            r.add(f"r{i}", rng.choice(workers), chain, now_s, start=start, hash_array=array)
        elif op < 0.8:
            r.discard(f"r{rng.randrange(i + 1)}")
        elif op < 0.82:
            r.forget_worker(rng.choice(workers))
        now_s += rng.random()
        r.expire(now_s)
        r.check_invariants()
        held = np.array([rng.randrange(len(chain) + 2) for _ in workers], dtype=np.int64)
        expected = [r.extend(w, chain, int(h)) for w, h in zip(workers, held, strict=True)]
        num_grown += sum(e > h for e, h in zip(expected, held.tolist(), strict=True))
        array = np.array(chain, dtype=np.uint64)
        assert r.extend_many(fleet, chain, held, array).tolist() == expected
        assert r.extend_many(fleet, chain, held).tolist() == expected
    assert num_grown > 50  # (the routes were found, not only ruled out)
    assert (
        r.extend_many(fleet, [], np.zeros(6, np.int64), np.zeros(0, np.uint64)).tolist() == [0] * 6
    )


def test_routed_prefixes_count_short_runs_that_share_hashes_until_each_is_dropped() -> None:
    r = RoutedPrefixes(ttl_s=10.0)
    r.add("r1", A, hashes(1, 2, 3), now_s=0.0)
    r.add("r2", A, hashes(2, 3, 4), now_s=0.0)  # shares 2, 3 with r1, on the same worker
    r.add("r3", B, hashes(3, 4, 5), now_s=0.0)  # and with another worker
    r.check_invariants()
    chain = hashes(1, 2, 3, 4, 5)
    assert (r.extend(A, chain, 0), r.extend(B, chain, 2)) == (4, 5)
    r.discard("r2")
    r.check_invariants()
    assert (r.extend(A, chain, 0), r.extend(B, chain, 2)) == (3, 5)
    r.discard("r1")
    r.discard("r3")
    r.check_invariants()
    assert r.extend(A, chain, 0) == 0 and r.extend(B, chain, 2) == 2


def test_routed_prefixes_count_a_run_sent_again_to_its_worker_once_until_its_last_request() -> None:
    r = RoutedPrefixes(ttl_s=10.0)
    run = hashes(*range(1, 41))  # past `_FEW_HASHES`, and within it below
    r.add("r1", A, run, now_s=0.0)
    r.add("r2", A, tuple(run), now_s=1.0)  # the same run, to the same worker: shared
    r.add("r3", B, run, now_s=1.0)  # to another worker: its own
    r.add("r4", A, run, now_s=1.0, start=30)  # a shorter run with the same last hash: its own
    r.add("r5", A, hashes(*range(100, 110), 40), now_s=1.0)  # 11 hashes ending as r4: its own
    r.check_invariants()
    chain = hashes(*range(1, 42))
    r.discard("r1")
    r.check_invariants()
    assert (r.extend(A, chain, 0), r.extend(B, chain, 0)) == (40, 40)
    r.discard("r2")
    r.check_invariants()
    assert (r.extend(A, chain, 0), r.extend(A, chain, 30), r.extend(B, chain, 0)) == (0, 40, 40)
    r.add("r6", A, hashes(*range(1, 31), *range(200, 210), 40), now_s=2.0)
    r.add("r7", A, hashes(*range(1, 31), *range(200, 210), 40), now_s=2.0)  # under r6's key
    r.add("r8", A, run, now_s=2.0)  # 40 hashes ending with 40, as r6's key: counted on its own
    r.check_invariants()
    for request_id in ("r4", "r6", "r8"):
        r.discard(request_id)
    r.check_invariants()
    assert r.extend(A, chain, 0) == 30 and r.extend(A, hashes(*range(1, 31), 200), 0) == 31
    r.expire(now_s=20.0)
    assert len(r) == 0 and r.extend(A, chain, 0) == 0 and r.extend(B, chain, 0) == 0
    r.check_invariants()


def test_routed_prefixes_stay_bounded_counting_shared_runs() -> None:
    r = RoutedPrefixes(ttl_s=10.0, max_entries=2)
    for i in range(3):
        r.add(f"r{i}", A, hashes(1, 2, 3), now_s=float(i))
    assert len(r) == 2 and r.extend(A, hashes(1, 2, 3), 0) == 3
    r.discard("r1")
    r.check_invariants()
    assert r.extend(A, hashes(1, 2, 3), 0) == 3
    r.discard("r2")
    assert len(r) == 0 and r.extend(A, hashes(1, 2, 3), 0) == 0
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


def test_recent_load_snapshot_arrays_agree_with_snapshot_when_the_clock_goes_back() -> None:
    # A sum stored after `now` (a clock that went back) is read undecayed, as `snapshot` has it,
    # at and after the latest stored time as well (to within an ulp: numpy's exp).
    load = RecentLoad(horizon_s=10.0)
    load.add(A, 50.0, now_s=3.0)
    load.add(B, 20.0, now_s=7.5)
    fleet = (A, B, WorkerId("c"))
    for now in (7.5, 9.0, 5.0, 2.0):
        work, requests = load.snapshot_arrays(fleet, now)
        expected_work, expected_requests = load.snapshot(list(fleet), now)
        assert work.tolist() == pytest.approx(expected_work, rel=1e-15), now
        assert requests.tolist() == pytest.approx(expected_requests, rel=1e-15), now
    assert load.snapshot_arrays(fleet, 2.0)[0].tolist() == [50.0, 20.0, 0.0]
    load.check_invariants()


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


def test_running_context_sums_prompts_until_done_or_expired() -> None:
    r = RunningContext(ttl_s=100.0)
    r.add("r1", A, 5000, now_s=0.0)
    r.add("r2", A, 300, now_s=1.0)
    r.add("r3", B, 700, now_s=2.0)
    assert (r.tokens(A), r.tokens(B)) == (5300, 700)
    r.discard("r1")
    r.discard("r1")  # a second report changes nothing
    assert r.tokens(A) == 300
    r.expire(now_s=101.5)  # r2 (routed at 1.0) is past its ttl, r3 not yet
    assert (r.tokens(A), r.tokens(B), len(r)) == (0, 700, 1)
    r.check_invariants()
    r.forget_worker(B)
    assert len(r) == 0 and r.tokens(B) == 0
    with pytest.raises(ValueError, match="ttl_s must be > 0, got 0"):
        RunningContext(ttl_s=0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        r.add("r4", A, -1, now_s=3.0)


# Only the decode term differs between the workers in these tests.
DECODE_ONLY = KvmeshWeights(placement_balance=0, request_balance=0, new_prefix_balance=0)
KV_CM = CostModel(decode_per_kv_token_ms=1e-4)


def _scores(d: RouteDecision) -> dict[str, float]:
    return {s.worker_id: s.cost_ms for s in d.scores}


def test_a_worker_whose_running_requests_read_more_kv_costs_more_per_token() -> None:
    p = KvmeshPolicy(KV_CM, random.Random(0), Clock(), DECODE_ONLY)
    for i, n in enumerate((8000, 4000)):  # two long conversations running on a
        p.choose(RouteQuery(f"long{i}", hashes(500 + i), n, 16), [view("a")])
    d = p.choose(query("q", hashes(1, 2)), [view("a"), view("b")])
    assert d.worker_id == "b"
    gap = _scores(d)["a"] - _scores(d)["b"]
    # 2 (its steps and theirs) x 16 tokens x 1e-4 ms x 12,000 tokens of KV more per step.
    assert gap == pytest.approx(2 * DECODE_ONLY.decode_tokens * 1e-4 * 12000)
    p.on_request_done("long0")
    p.on_request_done("long1")
    p.on_request_done("q")
    d = p.choose(query("q2", hashes(1, 2)), [view("a"), view("b")])
    assert _scores(d)["a"] == pytest.approx(_scores(d)["b"])


def test_decode_is_priced_over_a_share_of_the_answer_capped_and_default_when_unknown() -> None:
    w = KvmeshWeights()
    assert w.decode_tokens_for(None) == w.decode_tokens == 16.0
    assert w.decode_tokens_for(256) == 16.0  # a typical answer: priced as an unknown one
    assert w.decode_tokens_for(64) == 4.0  # an agent's action: a quarter of it
    assert w.decode_tokens_for(640) == 40.0
    assert w.decode_tokens_for(1 << 20) == w.max_decode_tokens == 64.0
    with pytest.raises(ValueError, match="decode_share must be >= 0, got -1"):
        KvmeshWeights(decode_share=-1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1 or None, got 0"):
        RouteQuery("r", hashes(1), 20, 16, max_tokens=0)


@pytest.mark.parametrize(("max_tokens", "lands_on"), [(24, "a"), (None, "a"), (640, "b")])
def test_a_short_answer_stays_with_its_cache_where_a_long_one_moves_off_a_busy_batch(
    max_tokens: int | None, lands_on: str
) -> None:
    p = KvmeshPolicy(KV_CM, random.Random(0), Clock(), DECODE_ONLY)
    for i in range(2):  # 20,000 tokens of running context on a: 2 ms more KV per step than b
        p.choose(RouteQuery(f"long{i}", hashes(500 + i), 10_000, 16), [view("a")])
    prefix = hashes(*range(1, 129))  # 2,048 tokens, held by a only
    q = RouteQuery("q", [*prefix, BlockHash(999)], 16 * 129 + 5, 16, max_tokens=max_tokens)
    d = p.choose(q, [view("a", matched=128), view("b")])
    # b saves nothing and recomputes the prefix (counted twice, ~83 ms); a's batch costs
    # 2 x tokens x 2 ms: 6 ms over 1.5 tokens (24 x 1/16), 64 ms over 16 (unknown), 160 over 40.
    assert d.worker_id == lands_on
    tokens = DECODE_ONLY.decode_tokens_for(max_tokens)
    saving = (1 + DECODE_ONLY.recompute_weight) * (
        KV_CM.prefill_ms(q.prompt_len) - KV_CM.prefill_ms(q.prompt_len - 2048, 2048)
    )
    gap = _scores(d)["a"] - _scores(d)["b"]
    assert gap == pytest.approx(2 * tokens * 1e-4 * 20_000 - saving)


def test_without_a_kv_price_the_batch_size_prices_decode() -> None:
    p = KvmeshPolicy(CM, random.Random(0), Clock(), DECODE_ONLY)
    busy = WorkerView(WorkerId("a"), 1000, 1000, 0.0, 0, 3, 0, 0)  # 3 running
    d = p.choose(query("q", hashes(1, 2)), [busy, view("b")])
    step = CM.decode_step_ms(3)  # the running batch rides along the prefill ...
    per_token = 2 * DECODE_ONLY.decode_tokens * 3 * CM.decode_per_seq_ms  # ... and slows decode
    assert _scores(d)["a"] - _scores(d)["b"] == pytest.approx(step + per_token)


@pytest.mark.parametrize("decode_tokens", [0.0, 16.0])
def test_a_hot_prefix_is_replicated_once_its_holders_batch_outweighs_recomputing_it(
    decode_tokens: float,
) -> None:
    weights = KvmeshWeights(placement_balance=0, request_balance=0, decode_tokens=decode_tokens)
    p = KvmeshPolicy(KV_CM, random.Random(0), Clock(), weights)
    prefix = hashes(*range(1, 129))  # 2,048 tokens on a, nowhere else
    holder, other = view("a", matched=128), view("b")
    landed = [
        p.choose(
            RouteQuery(f"r{i}", [*prefix, BlockHash(1000 + i)], 16 * 129 + 5, 16), [holder, other]
        ).worker_id
        for i in range(40)
    ]  # none finishes: a's batch keeps growing
    if decode_tokens == 0:
        assert set(landed) == {"a"}  # nothing prices the batch: the holder takes them all
    else:
        first_b = landed.index("b")
        # Continuous: b wins once a's extra KV per step, paid 2 x 16 times, passes the
        # recompute saving (prefill of the 2K prefix, counted twice) - not at a fixed count.
        saving = (1 + weights.recompute_weight) * (
            KV_CM.prefill_ms(16 * 129 + 5) - KV_CM.prefill_ms(16 * 129 + 5 - 2048, 2048)
        )
        extra_kv = 2 * 16 * 1e-4 * (16 * 129 + 5)
        assert first_b == pytest.approx(saving / extra_kv, abs=1.5)


def _warmed(policy_type: type[KvmeshPolicy], weights: KvmeshWeights | None = None) -> KvmeshPolicy:
    """A policy that has sent a and b alike six 150-block prompts each held where they went, on
    a six times the same prefix, on b six different ones: a has reused 150 blocks of its pool
    lately, b 900 (of 1,000), and the same work went to each."""
    p = policy_type(CM, random.Random(0), Clock(), weights)
    for i in range(6):
        same, other = hashes(*range(1, 151)), hashes(*range(1000 * i + 1, 1000 * i + 151))
        p.choose(RouteQuery(f"a{i}", same, 150 * 16, 16), [view("a", matched=150)])
        p.choose(RouteQuery(f"b{i}", other, 150 * 16, 16), [view("b", matched=150)])
    return p


BLOCK_MS = CM.prefill_per_token_ms * 16
PROMPT = query("r", hashes(*range(90_001, 90_021)))  # 21 blocks (20 full), held nowhere


def _costs(p: KvmeshPolicy, ws: list[WorkerView]) -> dict[WorkerId, float]:
    return {s.worker_id: s.cost_ms for s in p.choose(PROMPT, ws).scores}


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_a_copy_onto_a_pool_full_of_reused_prefixes_costs_more_than_onto_one_with_room(
    policy_type: type[KvmeshPolicy],
) -> None:
    # (Without the new-prefix balance, which sends the second new prompt away from the first.)
    p = _warmed(policy_type, KvmeshWeights(new_prefix_balance=0.0))
    cost = _costs(p, [view("a"), view("b")])
    # Each of the 21 stored blocks displaces one of the pool, reused with the share of the pool
    # the worker's reused prefixes fill: 150 / 1,000 on a, 900 / 1,000 on b.
    assert cost[B] - cost[A] == pytest.approx(4.0 * 21 * BLOCK_MS * (0.9 - 0.15))
    assert (
        p.choose(query("r2", hashes(*range(80_001, 80_021))), [view("a"), view("b")]).worker_id
        == "a"
    )


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_a_holder_stores_only_what_it_lacks_so_a_copy_pays_for_the_whole_prefix(
    policy_type: type[KvmeshPolicy],
) -> None:
    ws = [view("a", matched=20), view("b")]
    priced = _costs(_warmed(policy_type), ws)
    free = _costs(_warmed(policy_type, KvmeshWeights(eviction_weight=0.0)), ws)
    # a lacks only the partial tail block; b all 21.
    assert priced[A] - free[A] == pytest.approx(4.0 * 1 * BLOCK_MS * 0.15)
    assert priced[B] - free[B] == pytest.approx(4.0 * 21 * BLOCK_MS * 0.9)


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_a_pool_whose_traffic_reused_nothing_lately_stores_for_free(
    policy_type: type[KvmeshPolicy],
) -> None:
    ws = [view("a"), view("b", matched=20)]
    fresh = _costs(policy_type(CM, random.Random(0), Clock()), ws)
    unpriced = policy_type(CM, random.Random(0), Clock(), KvmeshWeights(eviction_weight=0.0))
    assert fresh == _costs(unpriced, ws)


def test_the_eviction_weight_is_validated() -> None:
    with pytest.raises(ValueError, match="eviction_weight must be >= 0, got -1"):
        KvmeshWeights(eviction_weight=-1)


def test_reused_prefixes_sum_distinct_prefixes_per_worker_until_the_horizon() -> None:
    r = ReusedPrefixes(horizon_s=10.0)
    r.add(A, BlockHash(7), 8, now_s=0.0)
    r.add(A, BlockHash(7), 6, now_s=1.0)  # the same prefix again: counted once, longest kept
    r.add(A, BlockHash(9), 4, now_s=2.0)
    r.add(B, BlockHash(7), 8, now_s=3.0)  # the same prefix on another worker: its own entry
    r.check_invariants()
    assert r.num_blocks(A) == 12 and r.num_blocks(B) == 8
    assert r.num_blocks_many([B, A, WorkerId("c")]).tolist() == [8, 12, 0]
    r.expire(11.0)  # (A, 7) was last reused at 1.0
    assert r.num_blocks(A) == 4
    r.forget_worker(B)
    r.check_invariants()
    assert r.num_blocks(B) == 0 and len(r) == 1


def test_reused_prefixes_stay_bounded() -> None:
    r = ReusedPrefixes(horizon_s=10.0, max_entries=3)
    for i in range(5):
        r.add(A, BlockHash(i + 1), 2, now_s=0.0)
    r.check_invariants()
    assert len(r) == 3 and r.num_blocks(A) == 6


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_each_queued_prefill_costs_a_step_of_the_batch_it_carries(
    policy_type: type[KvmeshPolicy],
) -> None:
    p = policy_type(KV_CM, random.Random(0), Clock(), DECODE_ONLY)
    for i in range(2):  # 20,000 tokens of running context on both: the same KV per step
        p.choose(RouteQuery(f"a{i}", hashes(500 + i), 10_000, 16), [view("a")])
        p.choose(RouteQuery(f"b{i}", hashes(600 + i), 10_000, 16), [view("b")])
    # on a, 5 cache hits wait for their (cheap) prefills besides the 2 running
    a = WorkerView(A, 1000, 1000, 10.0, 500, 7, 0, 0, 5)
    b = WorkerView(B, 1000, 1000, 10.0, 500, 2, 0, 0, 0)
    d = p.choose(query("q", hashes(1, 2)), [a, b])
    # each queued prefill rides a step of a's batch: fixed + per sequence + its KV read
    kv_ms = 1e-4 * 20_000
    per_step_a = KV_CM.decode_step_ms(7) + kv_ms
    gap = 5 * per_step_a + KV_CM.decode_step_ms(7) - KV_CM.decode_step_ms(2)
    assert d.worker_id == "b"
    assert _scores(d)["a"] - _scores(d)["b"] == pytest.approx(gap)


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
@pytest.mark.parametrize(("max_tokens", "answer_len"), [(160, 160.0), (None, 256.0)])
def test_blocks_held_are_priced_over_the_answer_by_how_much_of_the_pool_is_in_use(
    policy_type: type[KvmeshPolicy], max_tokens: int | None, answer_len: float
) -> None:
    p = policy_type(CM, random.Random(0), Clock(), DECODE_ONLY)
    q = RouteQuery("q", hashes(*range(1, 11)), 16 * 10 + 5, 16, max_tokens=max_tokens)
    busy = WorkerView(A, 1000, 100, 0.0, 0, 4, 0, 0)  # 90% of the pool in use
    roomy = WorkerView(B, 1000, 500, 0.0, 0, 4, 0, 0)  # 50%
    d = p.choose(q, [busy, roomy])
    # both would store the 11 prompt blocks and hold the answer's for its steps of a 4-batch:
    # the prompt's priced by the share of the pool in use, the answer's by its square
    per_block_ms = answer_len * CM.decode_step_ms(4) / 1000
    prompt_ms = 11 * per_block_ms * (0.9 - 0.5)
    answer_ms = answer_len / 16 * per_block_ms * (0.9**2 - 0.5**2)
    assert d.worker_id == "b"
    gap = _scores(d)["a"] - _scores(d)["b"]
    assert gap == pytest.approx(4.0 * (prompt_ms + answer_ms))


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_where_the_pool_is_in_use_a_copy_pays_for_holding_the_prefix_and_a_hit_does_not(
    policy_type: type[KvmeshPolicy],
) -> None:
    weights = KvmeshWeights(placement_balance=0, request_balance=0, recompute_weight=0)
    p = policy_type(CM, random.Random(0), Clock(), weights)
    q = RouteQuery("q", hashes(*range(1, 11)), 16 * 10 + 5, 16, max_tokens=640)
    holder = WorkerView(A, 1000, 100, 0.0, 0, 4, 10, 10)
    other = WorkerView(B, 1000, 100, 0.0, 0, 4, 0, 0)
    d = p.choose(q, [holder, other])
    step = CM.decode_step_ms(4)
    # the 10 prefix blocks, over 640 steps, by the share in use (they stay for the followers)
    copy_ms = 4.0 * 10 / 1000 * 640 * step * 0.9
    prefill_gap = CM.prefill_ms(165, 0) - CM.prefill_ms(165 - 160, 160)
    assert d.worker_id == "a"
    assert _scores(d)["b"] - _scores(d)["a"] == pytest.approx(prefill_gap + copy_ms)


def test_the_memory_weight_is_validated() -> None:
    with pytest.raises(ValueError, match="memory_weight must be >= 0, got -1"):
        KvmeshWeights(memory_weight=-1)


@pytest.mark.parametrize("policy_type", [KvmeshPolicy, KvmeshReferencePolicy])
def test_a_prompt_nobody_holds_goes_where_fewer_new_prompts_went_whatever_the_queue(
    policy_type: type[KvmeshPolicy],
) -> None:
    def routed(weights: KvmeshWeights, matched_on_a: int) -> RouteDecision:
        p = policy_type(CM, random.Random(0), Clock(), weights)
        for i in range(2):  # two prompts placed on a from scratch
            p.choose(query(f"n{i}", hashes(100 * i + 1, 100 * i + 2)), [view("a")])
        q = query("q", hashes(7, 8))
        return p.choose(q, [view("a", matched=matched_on_a), view("b", queued_ms=15.0)])

    weights = KvmeshWeights()
    ready = CM.prefill_ms(16 * 2 + 5)
    dealt = routed(weights, 0)
    by_load = routed(replace(weights, new_prefix_balance=0.0), 0)
    assert (dealt.worker_id, by_load.worker_id) == ("b", "a")
    gap = _scores(dealt)["a"] - _scores(by_load)["a"]
    assert gap == pytest.approx(weights.new_prefix_balance * 2 * ready)
    assert _scores(dealt)["b"] == _scores(by_load)["b"]
    # a holds a block of it: the prompt is no longer new, and is priced without the term
    held = routed(weights, 1)
    assert _scores(held) == _scores(routed(replace(weights, new_prefix_balance=0.0), 1))


def test_reused_sums_of_a_fleet_are_kept_until_a_sum_changes() -> None:
    reused = ReusedPrefixes(horizon_s=10.0)
    fleet = (A, B)
    reused.add(A, BlockHash(7), 4, now_s=0.0)
    first = reused.num_blocks_many(fleet)
    assert first.tolist() == [4, 0] and not first.flags.writeable
    reused.add(A, BlockHash(7), 3, now_s=1.0)  # shorter than before: no sum changes
    assert reused.num_blocks_many(fleet) is first
    reused.check_invariants()
    reused.add(B, BlockHash(9), 2, now_s=2.0)
    assert reused.num_blocks_many(fleet).tolist() == [4, 2]
    reused.expire(now_s=11.5)  # A's prefix (last used at 1.0) goes
    assert reused.num_blocks_many(fleet).tolist() == [0, 2]
    reused.forget_worker(B)
    assert reused.num_blocks_many(fleet).tolist() == [0, 0]
    assert reused.num_blocks_many((B,)).tolist() == [0]
    reused.check_invariants()
