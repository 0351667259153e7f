"""Sessions in the coordinator: the session reaches the worker (and survives a migration), its
affinity is a visible cost term, and a turn may refuse or wait for another turn in flight."""

from __future__ import annotations

import threading

import pytest

from kvmesh.coordinator.session_turns import SessionBusy, SessionTurns, TurnMode
from kvmesh.workers.contract.requests import SamplingConfig
from tests.unit.generate_args import generate_args
from tests.unit.test_coordinator import PROMPT, make


def test_session_id_reaches_the_worker_and_survives_a_migration() -> None:
    c, backend, _, _ = make()
    prompt = c.prompts.prepare(PROMPT, "", "")
    first = list(c.generate(prompt, SamplingConfig(max_tokens=2), session_id="chat"))
    home = first[0].worker_id
    backend.die.add(home)  # the session's worker dies during the next turn
    turn = c.generate(prompt, SamplingConfig(max_tokens=4), session_id="chat", worker_id=home)
    events = list(turn)
    assert len({e.worker_id for e in events}) == 2  # moved mid-stream
    assert [r.session_id for _, r in backend.requests] == ["chat"] * 3
    assert backend.requests[-1][1].request_id.endswith(".m1")
    assert c.stats()["num_migrations"] == 1


def test_route_shows_the_session_affinity_it_applied() -> None:
    c, _, _, _ = make()
    prompt = c.prompts.prepare(PROMPT, "", "")
    list(c.generate(prompt, SamplingConfig(max_tokens=1), session_id="chat"))
    d = c.route(prompt, "chat")
    assert d.session_worker_id in ("w0", "w1")
    per_block = c.cost_model.prefill_per_token_ms * 16
    assert d.session_affinity_ms == pytest.approx(per_block)
    assert c.route(prompt, "other").session_affinity_ms == 0.0


def test_affinity_weight_is_a_config_value() -> None:
    from kvmesh.coordinator.config import CoordinatorConfig

    with pytest.raises(ValueError, match="session_affinity_blocks"):
        CoordinatorConfig(session_affinity_blocks=-1.0)


def test_second_concurrent_turn_is_refused_when_asked() -> None:
    c, backend, _, _ = make()
    prompt = c.prompts.prepare(PROMPT, "", "")
    first = c.generate(prompt, SamplingConfig(max_tokens=3), session_id="chat")
    next(first)  # the first turn is streaming
    second = c.generate(
        prompt, SamplingConfig(max_tokens=1), session_id="chat", turn_mode=TurnMode.REFUSE
    )
    with pytest.raises(SessionBusy):
        next(second)
    assert len(backend.requests) == 1  # the refused turn never reached a worker
    list(first)
    again = c.generate(
        prompt, SamplingConfig(max_tokens=1), session_id="chat", turn_mode=TurnMode.REFUSE
    )
    assert list(again)[-1].finished
    assert c.stats()["num_session_turns_refused"] == 1


def test_other_sessions_and_concurrent_turns_are_not_held() -> None:
    turns = SessionTurns()
    turns.begin("a", TurnMode.REFUSE)
    turns.begin("b", TurnMode.REFUSE)
    turns.begin("a", TurnMode.CONCURRENT)
    assert turns.num_in_flight("a") == 2
    turns.end("a")
    turns.end("a")
    turns.end("b")
    turns.check_invariants()
    with pytest.raises(ValueError, match="more turns"):
        turns.end("a")


def test_queued_turn_starts_when_the_previous_one_ends() -> None:
    turns = SessionTurns()
    turns.begin("chat", TurnMode.REFUSE)
    started = threading.Event()

    def second() -> None:
        turns.begin("chat", TurnMode.QUEUE, timeout_s=60.0)
        started.set()

    t = threading.Thread(target=second)
    t.start()
    assert not started.wait(0.05)  # still held: the first turn is in flight
    turns.end("chat")
    t.join(timeout=60.0)
    assert started.is_set() and turns.num_in_flight("chat") == 1
    turns.check_invariants()


def test_queued_turn_is_refused_when_the_wait_runs_out() -> None:
    now = [0.0]

    def clock() -> float:  # every reading is 10 s later: the deadline passes before a wait
        now[0] += 10.0
        return now[0]

    turns = SessionTurns(clock=clock)
    turns.begin("chat", TurnMode.REFUSE)
    with pytest.raises(SessionBusy, match="waited"):
        turns.begin("chat", TurnMode.QUEUE, timeout_s=5.0)
    assert turns.num_waiting == 0 and turns.num_refused == 1


def test_client_sends_the_turn_mode_and_maps_failed_precondition() -> None:
    import grpc

    from kvmesh.client import SessionBusy as ClientSessionBusy
    from kvmesh.client import wire
    from kvmesh.client.errors import error_class_for
    from kvmesh.proto import kvmesh_pb2 as pb

    kwargs = generate_args(session_id="chat")
    request = wire.build_generate_request([1, 2], turn_mode="queue", **kwargs)  # type: ignore[arg-type]
    assert request.turn_mode == pb.TURN_MODE_QUEUE
    with pytest.raises(ValueError, match="turn_mode"):
        wire.build_generate_request([1, 2], turn_mode="alone", **kwargs)  # type: ignore[arg-type]
    assert error_class_for(grpc.StatusCode.FAILED_PRECONDITION) is ClientSessionBusy
