"""A replica's side of the decision log (`coordinator/decision_replica.py`): a lost commit
applies the winner and decides again, a forced commit waits for the entries before it, a log
that is away leaves the replica deciding alone."""

from __future__ import annotations

from kvmesh.coordinator.sim.decision_log import SimDecisionLog
from kvmesh.proto.placements import Placement
from kvmesh.workers.contract.requests import SamplingConfig
from tests.unit.test_coordinator import PROMPT, make
from tests.unit.test_decision_log import placement, policy_state


def test_a_replica_that_loses_a_commit_applies_the_winner_and_decides_again() -> None:
    """Two replicas decide at once on the same state; the second's commit loses, it applies
    the first's decision and decides again; both end with the same policy state, the one a
    single coordinator routing both requests would have."""
    a, backend_a, _, _ = make(("w0", "w1"))
    b, backend_b, _, _ = make(("w0", "w1"))
    single, _, _, _ = make(("w0", "w1"))
    log = SimDecisionLog(lambda: 0.0, 1e9, 2)  # the stream never delivers: only commits tell
    for c in (a, b):
        c.decisions.log = log
    sampling = SamplingConfig(max_tokens=2)
    prompt = a.prompts.prepare(PROMPT, "", "")
    stream_a = a.generate(prompt, sampling, request_id="r1")  # routed and committed
    stream_b = b.generate(prompt, sampling, request_id="r2")
    assert b.counters.num_commit_attempts == 2 and b.counters.num_commits == 1
    stats = b.stats()  # what Stats and the metrics endpoint report
    assert (stats["num_decision_commits"], stats["num_decision_lost_commits"]) == (1, 1)
    assert a.stats()["num_decision_lost_commits"] == 0
    assert b.decisions.cursor.applied_seq == 2 and a.decisions.cursor.applied_seq == 1
    a.decisions.observe([(1, placement_of(log, 1)), (2, placement_of(log, 2))])
    assert a.decisions.cursor.applied_seq == 2
    single_a = single.generate(prompt, sampling, request_id="r1")
    single_b = single.generate(prompt, sampling, request_id="r2")
    assert policy_state(a) == policy_state(b) == policy_state(single)
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
    b.decisions.max_commit_retries = 0
    log = SimDecisionLog(lambda: 0.0, 1e9, 2)
    a.decisions.log = b.decisions.log = log
    prompt = a.prompts.prepare(PROMPT, "", "")
    list(a.generate(prompt, SamplingConfig(max_tokens=1), request_id="r1"))
    list(b.generate(prompt, SamplingConfig(max_tokens=1), request_id="r2"))
    assert b.counters.num_forced_commits == 1 and b.counters.num_commit_attempts == 1
    assert len(log) == 2
    # Its own entry waits for the one before it, then both apply in order.
    assert b.decisions.cursor.applied_seq == 0
    b.decisions.observe([(1, placement_of(log, 1))])
    assert b.decisions.cursor.applied_seq == 2


class AwayLog:
    """A decision log whose store is unreachable."""

    def commit(self, expected_seq: int | None, placement: Placement) -> None:
        return None


def test_with_the_log_away_a_replica_decides_alone_and_counts_it() -> None:
    a, backend, _, _ = make(("w0", "w1"))
    a.decisions.log = AwayLog()  # type: ignore[assignment]
    prompt = a.prompts.prepare(PROMPT, "", "")
    list(a.generate(prompt, SamplingConfig(max_tokens=1), request_id="r1"))
    assert len(backend.requests) == 1
    assert a.counters.num_unlogged == 1 and a.decisions.cursor.applied_seq == 0
