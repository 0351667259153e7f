"""Peer routes: another replica's requests, as workers and coordinators note them, count in
this replica's load tracker as if it had routed them."""

from __future__ import annotations

import pytest

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.load_tracker import LoadTracker
from kvmesh.coordinator.routing.peer_routes import PeerRoutes
from kvmesh.proto.request_notes import NoteBatch, RequestFinished, RequestPrefilled, RequestTaken

CM = CostModel()
W = WorkerId("w0")


class Replica:
    def __init__(self, origin: str = "me", ttl_s: float = 600.0, max_entries: int = 100) -> None:
        self.now_s = 0.0
        self.load = LoadTracker()
        self.peers = PeerRoutes(origin, self.load, ttl_s, max_entries)

    def note(self, *notes: RequestTaken | RequestPrefilled | RequestFinished) -> None:
        self.peers.apply(NoteBatch(W, notes), CM, self.now_s)
        self.peers.check_invariants()
        self.load.check_invariants()


def test_a_peer_request_counts_in_the_load_until_it_finishes() -> None:
    r = Replica()
    r.note(RequestTaken("r1", "peer", 1000, 600))
    assert r.load.queued_prefill_tokens(W) == 600
    assert r.load.queued_prefill_ms(W) == pytest.approx(CM.prefill_ms(600, 400))
    assert r.load.num_running(W) == 1
    r.note(RequestPrefilled("r1"))
    assert r.load.queued_prefill_tokens(W) == 0
    assert r.load.num_running(W) == 1
    r.note(RequestFinished("r1"))
    assert r.load.num_running(W) == 0
    assert len(r.peers) == 0


def test_own_requests_are_not_counted_twice() -> None:
    r = Replica(origin="me")
    r.load.on_routed("r1", W, 5.0, 100)
    r.note(RequestTaken("r1", "me", 1000, 100), RequestPrefilled("r1"), RequestFinished("r1"))
    assert r.load.num_running(W) == 1  # still ours: our own stream ends it
    assert r.peers.num_taken == 0


def test_a_request_noted_twice_or_after_its_end_counts_once() -> None:
    r = Replica()
    r.note(RequestTaken("r1", "peer", 100, 100))
    r.note(RequestTaken("r1", "peer", 100, 80))  # its worker's note, a step later
    assert r.load.num_running(W) == 1 and r.peers.num_taken == 1
    r.note(RequestFinished("r1"))
    r.note(RequestTaken("r1", "peer", 100, 100))  # a routing note that lagged behind the end
    assert r.load.num_running(W) == 0 and r.peers.num_taken == 1


def test_a_client_id_this_replica_also_routed_is_left_to_it() -> None:
    r = Replica()
    r.load.on_routed("same", W, 5.0, 100)
    r.note(RequestTaken("same", "peer", 100, 100))
    assert r.load.num_running(W) == 1 and len(r.peers) == 0


def test_notes_of_requests_never_seen_taken_are_ignored() -> None:
    r = Replica()
    r.note(RequestPrefilled("x"), RequestFinished("x"))
    assert len(r.peers) == 0 and r.load.num_running(W) == 0


def test_a_peer_request_whose_end_is_lost_expires() -> None:
    r = Replica(ttl_s=10.0)
    r.note(RequestTaken("r1", "peer", 100, 100))
    r.now_s = 9.0
    r.peers.expire(r.now_s)
    assert r.load.num_running(W) == 1
    r.now_s = 10.0
    r.peers.expire(r.now_s)
    assert r.load.num_running(W) == 0 and len(r.peers) == 0


def test_memory_is_bounded_by_max_entries() -> None:
    r = Replica(max_entries=3)
    for i in range(5):
        r.note(RequestTaken(f"r{i}", "peer", 100, 100))
    assert len(r.peers) == 3 and r.load.num_running(W) == 3


def test_a_worker_that_leaves_takes_its_peer_requests_along() -> None:
    r = Replica()
    r.note(RequestTaken("r1", "peer", 100, 100))
    r.load.forget_worker(W)
    r.peers.forget_worker(W)
    r.peers.check_invariants()
    assert len(r.peers) == 0


def test_a_replica_needs_an_origin() -> None:
    with pytest.raises(ValueError, match="origin"):
        PeerRoutes("", LoadTracker())


def test_clearing_lets_go_of_every_peer_request_and_ignores_their_late_notes() -> None:
    r = Replica()
    r.note(RequestTaken("r1", "peer", 100, 100), RequestTaken("r2", "peer", 100, 50))
    r.peers.clear()
    assert len(r.peers) == 0 and r.load.num_running(W) == 0
    r.note(RequestTaken("r1", "peer", 100, 100))  # its worker's note, read after the rebuild
    assert len(r.peers) == 0
