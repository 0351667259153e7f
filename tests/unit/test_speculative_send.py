"""Speculative dispatch (`coordinator/speculative_send.py`, `decision_replica.py`): a request
goes to its worker before its decision is committed; a lost commit that keeps the worker commits
what was sent, one that moves the request aborts it there and redirects it, and the log still
holds every replica's final placements in order (fake backend, injected clock, no Redis)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.coordinator.routing.decision_log import CommitResult
from kvmesh.coordinator.sim.decision_log import SimDecisionLog
from kvmesh.proto.placements import Placement
from kvmesh.workers.contract.requests import SamplingConfig
from tests.unit.test_coordinator import PROMPT, FakeBackend, hold, make
from tests.unit.test_decision_log import policy_state
from tests.unit.test_decision_replica import placement_of

SAMPLING = SamplingConfig(max_tokens=3)
OTHER = [(i * 13) % 250 + 5 for i in range(200)]  # shares no block with PROMPT


def speculative(workers: tuple[str, ...] = ("w0", "w1")):  # type: ignore[no-untyped-def]
    c, backend, mirror, registry = make(workers)
    c.config = replace(c.config, decision_log=True, speculative_dispatch=True)
    return c, backend, mirror


class WatchedLog:
    """A log that records, at each commit, what the replica had already sent."""

    def __init__(self, log: SimDecisionLog, backend: FakeBackend) -> None:
        self.log, self.backend = log, backend
        self.sent_at_commit: list[list[tuple[str, str]]] = []

    def commit(self, expected_seq: int | None, placement: Placement) -> CommitResult:
        self.sent_at_commit.append(list(self.backend.sent))
        return self.log.commit(expected_seq, placement)


def test_a_request_is_on_its_way_to_its_worker_before_its_commit() -> None:
    c, backend, mirror = speculative()
    log = WatchedLog(SimDecisionLog(lambda: 0.0, 1e9, 1), backend)
    c.decisions.log = log
    prompt = c.prompts.prepare(PROMPT, "", "")
    hold(mirror, "w1", prompt.block_hashes[:32])
    events = list(c.generate(prompt, SAMPLING, request_id="r1"))
    assert log.sent_at_commit == [[("w1", "r1")]]  # sent, then committed
    assert backend.requests[0][0] == "w1" and backend.aborted == []
    assert [t for e in events for t in e.token_ids] == [100, 101, 102]
    stats = c.stats()
    assert (stats["num_speculative_sends"], stats["num_decision_redirects"]) == (1, 0)
    assert stats["num_decision_commits"] == 1
    assert placement_of(log.log, 1).request_id == "r1"


def test_without_the_switch_the_commit_comes_first() -> None:
    c, backend, _ = speculative()
    c.config = replace(c.config, speculative_dispatch=False)
    log = WatchedLog(SimDecisionLog(lambda: 0.0, 1e9, 1), backend)
    c.decisions.log = log
    list(c.generate(c.prompts.prepare(PROMPT, "", ""), SAMPLING, request_id="r1"))
    assert log.sent_at_commit == [[]] and backend.sent == [] and len(backend.requests) == 1
    assert c.stats()["num_speculative_sends"] == 0


def two_replicas():  # type: ignore[no-untyped-def]
    a, backend_a, mirror_a = speculative()
    b, backend_b, mirror_b = speculative()
    log = SimDecisionLog(lambda: 0.0, 1e9, 2)  # the stream never delivers: only commits tell
    a.decisions.log = b.decisions.log = log
    return (a, backend_a, mirror_a), (b, backend_b, mirror_b), log


def test_a_lost_commit_that_moves_the_request_aborts_it_and_redirects_it() -> None:
    """Both replicas decide on the same (empty) state and pick the same worker for two
    unrelated prompts; b's commit loses to a's, b applies a's decision (a long prefill queued
    there) and now prefers the other worker: it aborts its copy and sends the request there,
    under a new id. The stream yields that worker's tokens only, and both replicas' policy
    state is that of one coordinator routing both requests."""
    (a, backend_a, _), (b, backend_b, _), log = two_replicas()
    single, single_backend, _ = speculative()
    single.decisions.log = SimDecisionLog(lambda: 0.0, 1e9, 1)
    prompt = a.prompts.prepare(PROMPT, "", "")
    unrelated = b.prompts.prepare(OTHER, "", "")
    stream_a = a.generate(prompt, SAMPLING, request_id="r1")
    stream_b = b.generate(unrelated, SAMPLING, request_id="r2")
    first = backend_a.sent[0][0]
    other = "w1" if first == "w0" else "w0"
    assert backend_b.sent == [(first, "r2"), (other, "r2.r1")]
    assert backend_b.aborted == [(first, "r2")]  # closed unread: nothing of it reaches b
    stats = b.stats()
    assert (stats["num_speculative_sends"], stats["num_decision_redirects"]) == (1, 1)
    assert (stats["num_decision_commits"], stats["num_decision_lost_commits"]) == (1, 1)
    # The log holds the final placements, in order; a applies b's from it and agrees with b,
    # and with one coordinator that routed both.
    entries = [placement_of(log, 1), placement_of(log, 2)]
    assert [(p.request_id, p.worker_id) for p in entries] == [("r1", first), ("r2.r1", other)]
    a.decisions.observe(list(enumerate(entries, 1)))
    single_a = single.generate(prompt, SAMPLING, request_id="r1")
    single_b = single.generate(unrelated, SAMPLING, request_id="r2")
    assert [w for w, _ in single_backend.sent] == [first, other]
    assert policy_state(a) == policy_state(b) == policy_state(single)
    events = list(stream_b)
    assert {e.worker_id for e in events} == {other}
    assert [t for e in events for t in e.token_ids] == [100, 101, 102]
    assert [(w, r.request_id) for w, r in backend_b.requests] == [(other, "r2.r1")]
    list(stream_a), list(single_a), list(single_b)
    assert b.decisions.move_rate > a.decisions.move_rate == 0.0  # b's decision moved
    # b's load tracker let go of its request (it ran under its new id); what is left on the
    # first worker is a's r1, heard of through the log (its end would come in a worker note).
    assert b.load.num_running(other) == 0 and b.load.num_running(first) == 1
    b.load.check_invariants()


def test_a_lost_commit_that_keeps_the_worker_commits_what_was_sent() -> None:
    """w1 holds the prompt's prefix: after applying a's decision, b still picks w1, so the
    request it already sent there is the one that runs, under its own id."""
    (a, _, mirror_a), (b, backend_b, mirror_b), log = two_replicas()
    prompt = a.prompts.prepare(PROMPT, "", "")
    for mirror in (mirror_a, mirror_b):
        hold(mirror, "w1", prompt.block_hashes)
    short = a.prompts.prepare(PROMPT[: 16 * 8], "", "")
    stream_a = a.generate(short, SAMPLING, request_id="r1")
    events = list(b.generate(prompt, SAMPLING, request_id="r2"))
    assert b.counters.num_commit_attempts == 2  # lost once
    assert backend_b.sent == [("w1", "r2")] and backend_b.aborted == []
    assert {e.worker_id for e in events} == {"w1"}
    assert placement_of(log, 2).request_id == "r2" and placement_of(log, 2).worker_id == "w1"
    assert b.stats()["num_decision_redirects"] == 0
    list(stream_a)


class BrokenLog:
    def commit(self, expected_seq: int | None, placement: Placement) -> CommitResult:
        raise ConnectionError("the store went away mid-call")


def test_routing_that_fails_after_a_send_aborts_what_was_sent() -> None:
    c, backend, _ = speculative()
    c.decisions.log = BrokenLog()  # type: ignore[assignment]
    with pytest.raises(ConnectionError):
        c.generate(c.prompts.prepare(PROMPT, "", ""), SAMPLING, request_id="r1")
    assert len(backend.sent) == 1 and backend.aborted == backend.sent
    assert backend.requests == []


def test_speculation_pauses_while_lost_commits_keep_moving_decisions() -> None:
    """Where decisions collide so often that many move, a redirect costs more than the trip
    saves: the replica commits first again until few recent decisions moved."""
    c, backend, _ = speculative()
    log = WatchedLog(SimDecisionLog(lambda: 0.0, 1e9, 1), backend)
    c.decisions.log = log
    prompt = c.prompts.prepare(PROMPT, "", "")
    c.decisions.move_rate = 2 * c.config.speculation_max_move_rate
    list(c.generate(prompt, SAMPLING, request_id="r1"))
    assert log.sent_at_commit == [[]] and backend.sent == []  # committed, then sent
    assert c.stats()["num_speculative_sends"] == 0
    # Decisions that do not move bring the rate down; then requests go out before commits.
    k = 2
    while not c.decisions.speculates:
        list(c.generate(prompt, SAMPLING, request_id=f"r{k}"))
        k += 1
    assert backend.sent == [] and k > 2
    list(c.generate(prompt, SAMPLING, request_id="last"))
    assert backend.sent == [(backend.requests[-1][0], "last")]
    assert log.sent_at_commit[-1] == backend.sent
