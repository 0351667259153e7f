"""The decision log: entries applied in sequence order, each once, and replicas that lose a
commit deciding again on the state one coordinator would have had."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.coordinator.routing.decision_log import LogCursor
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.sim.decision_log import SimDecisionLog
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.placements import (
    Placement,
    PlacementDecodeError,
    decode_placement,
    encode_placement,
)
from kvmesh.workers.contract.requests import SamplingConfig
from tests.unit.test_coordinator import PROMPT, make


def placement(rid: str, worker: str = "w0", origin: str = "a") -> Placement:
    return Placement(rid, origin, worker, "", 100, 60, 3.5, (BlockHash(1), BlockHash(2)))


def test_entries_apply_in_sequence_order_each_once() -> None:
    cursor = LogCursor()
    p1, p2, p3 = placement("r1"), placement("r2"), placement("r3")
    assert cursor.offer([(2, p2), (3, p3)]) == []  # 1 is missing: wait for it
    cursor.check_invariants()
    assert cursor.offer([(1, p1), (2, p2)]) == [p1, p2, p3]
    assert cursor.offer([(3, p3)]) == []  # already applied
    assert cursor.applied_seq == 3
    cursor.check_invariants()


def test_a_gap_that_never_fills_is_stepped_over_and_counted() -> None:
    cursor = LogCursor()
    p5 = placement("r5")
    cursor.offer([(5, p5)])
    assert cursor.skip_to(4) == [p5]
    assert cursor.applied_seq == 5 and cursor.num_skipped == 4


def test_a_log_that_went_back_is_followed_from_its_new_end() -> None:
    cursor = LogCursor(applied_seq=10)
    cursor.offer([(12, placement("r12"))])
    assert cursor.skip_to(0) == []
    assert cursor.applied_seq == 0
    cursor.check_invariants()
    assert cursor.offer([(1, placement("x"))]) == [placement("x")]


def test_a_placement_survives_the_wire() -> None:
    hashes = tuple(BlockHash(h) for h in (1, 2**64 - 1))
    p = Placement("r1", "a", "w3", "s", 1000, 400, 12.25, hashes, 37, BlockHash(2**64 - 2), 640)
    assert decode_placement(encode_placement(p)) == p
    with pytest.raises(PlacementDecodeError):
        decode_placement(b"\x93\x01\x02")
    with pytest.raises(ValueError):
        Placement("r1", "a", "w0", "", 10, 11, 1.0)


def test_choose_is_propose_then_place() -> None:
    """`choose` remembers exactly what `place` of its decision would."""
    a, _, _, _ = make(("w0", "w1", "w2"))
    b, _, _, _ = make(("w0", "w1", "w2"))
    assert isinstance(a.policy, KvmeshPolicy) and isinstance(b.policy, KvmeshPolicy)
    for k in range(6):
        prompt = a.prompts.prepare(PROMPT[: 200 + 97 * k], "", "")
        answer = (None, 8, 640)[k % 3]
        decision = a.route(prompt, f"s{k % 2}", f"r{k}", answer)
        query = _query(prompt, f"s{k % 2}", f"r{k}", answer)
        b.policy.place(b._placement(query, decision), 0.0)
    assert _policy_state(a) == _policy_state(b)


def _query(prompt, session: str, rid: str, max_tokens: int | None = None):  # type: ignore[no-untyped-def]
    from kvmesh.coordinator.routing.policy import RouteQuery

    n = len(prompt.token_ids)
    return RouteQuery(rid, prompt.block_hashes, n, 16, session, max_tokens=max_tokens)


def _policy_state(c) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    """What the kvmesh policy remembers, per worker: recent work and requests, running context
    tokens, routed blocks of the test prompt, reused prefixes' blocks, the sessions' workers."""
    policy = c.policy
    ids = sorted(c.registry.routable())
    work, requests = policy._recent.snapshot(ids, 0.0)
    running = policy._running.tokens_many(ids).tolist()
    hashes = c.prompts.prepare(PROMPT, "", "").block_hashes
    routed = [policy._routed.extend(w, hashes, 0) for w in ids]
    sessions = [policy._sessions.get(s) for s in ("s0", "s1")]
    reused = policy._reused.num_blocks_many(ids).tolist()
    answers = policy._running.output_tokens_many(ids).tolist()
    return (work, requests, running, routed, sessions, reused, answers)


def test_a_replica_that_loses_a_commit_applies_the_winner_and_decides_again() -> None:
    """Two replicas decide at once on the same state; the second's commit loses, it applies
    the first's decision and decides again; both end with the same policy state, the one a
    single coordinator routing both requests would have."""
    a, backend_a, _, _ = make(("w0", "w1"))
    b, backend_b, _, _ = make(("w0", "w1"))
    single, _, _, _ = make(("w0", "w1"))
    log = SimDecisionLog(lambda: 0.0, 1e9, 2)  # the stream never delivers: only commits tell
    for c in (a, b):
        c.decision_log = log
    sampling = SamplingConfig(max_tokens=2)
    prompt = a.prompts.prepare(PROMPT, "", "")
    stream_a = a.generate(prompt, sampling, request_id="r1")  # routed and committed
    stream_b = b.generate(prompt, sampling, request_id="r2")
    assert b.counters.num_commit_attempts == 2 and b.counters.num_commits == 1
    stats = b.stats()  # what Stats and the metrics endpoint report
    assert (stats["num_decision_commits"], stats["num_decision_lost_commits"]) == (1, 1)
    assert a.stats()["num_decision_lost_commits"] == 0
    assert b.log_cursor.applied_seq == 2 and a.log_cursor.applied_seq == 1
    a.observe_decisions([(1, placement_of(log, 1)), (2, placement_of(log, 2))])
    assert a.log_cursor.applied_seq == 2
    single_a = single.generate(prompt, sampling, request_id="r1")
    single_b = single.generate(prompt, sampling, request_id="r2")
    assert _policy_state(a) == _policy_state(b) == _policy_state(single)
    list(stream_a), list(stream_b), list(single_a), list(single_b)
    # b saw r1 placed on its worker, as the single coordinator did: r2 follows r1 there.
    single_workers = [w for w, _ in single.backend.requests]  # type: ignore[attr-defined]
    assert [backend_a.requests[0][0], backend_b.requests[0][0]] == single_workers


def placement_of(log: SimDecisionLog, seq: int) -> Placement:
    missed = log.commit(seq - 1, placement("probe")).missed if seq <= len(log) else ()
    return dict(missed)[seq]


def test_after_the_retry_bound_a_decision_is_appended_without_the_check() -> None:
    a, _, _, _ = make(("w0", "w1"))
    b, _, _, _ = make(("w0", "w1"))
    b.config = replace(b.config, max_commit_retries=0)
    log = SimDecisionLog(lambda: 0.0, 1e9, 2)
    a.decision_log = b.decision_log = log
    prompt = a.prompts.prepare(PROMPT, "", "")
    list(a.generate(prompt, SamplingConfig(max_tokens=1), request_id="r1"))
    list(b.generate(prompt, SamplingConfig(max_tokens=1), request_id="r2"))
    assert b.counters.num_forced_commits == 1 and b.counters.num_commit_attempts == 1
    assert len(log) == 2
    # Its own entry waits for the one before it, then both apply in order.
    assert b.log_cursor.applied_seq == 0
    b.observe_decisions([(1, placement_of(log, 1))])
    assert b.log_cursor.applied_seq == 2


class AwayLog:
    """A decision log whose store is unreachable."""

    def commit(self, expected_seq: int | None, placement: Placement) -> None:
        return None


def test_with_the_log_away_a_replica_decides_alone_and_counts_it() -> None:
    a, backend, _, _ = make(("w0", "w1"))
    a.decision_log = AwayLog()  # type: ignore[assignment]
    prompt = a.prompts.prepare(PROMPT, "", "")
    list(a.generate(prompt, SamplingConfig(max_tokens=1), request_id="r1"))
    assert len(backend.requests) == 1
    assert a.counters.num_unlogged == 1 and a.log_cursor.applied_seq == 0
