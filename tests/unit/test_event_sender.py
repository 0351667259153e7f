"""The engine's event sender (`workers/event_sender.py`): steps published in order, a step's last
outputs only after its events, the engine held back only when sends pile up."""

from __future__ import annotations

import threading
import time

import pytest

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.event_sender import EventSender


def batch(seq: int) -> EventBatch:
    return EventBatch("w0", 1, seq, (BlockStored((BlockHash(seq),), 0, BlockHash(0), 0),))


def done(rid: str) -> RequestOutput:
    return RequestOutput(rid, (7,), True, "length")


class Log:
    """What the sender did, in order, from its own thread."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.hold = hold
        self.entries: list[str] = []
        self.publishing = threading.Event()

    def publish(self, events: EventBatch | None, notes: object) -> None:
        self.publishing.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        self.entries.append(f"publish {events.seq if events else None}")

    def deliver(self, rid: str, output: RequestOutput) -> None:
        self.entries.append(f"deliver {rid}")


def test_each_steps_last_outputs_leave_after_its_events_and_steps_stay_in_order() -> None:
    log = Log()
    sender = EventSender(log.publish, log.deliver, max_pending=8)
    sender.send(batch(1), None, (done("a"),))
    sender.send(None, None, (done("b"), done("c")))  # nothing to publish: delivered in turn
    sender.send(batch(2), None)
    sender.send(batch(3), None, (done("d"),))
    assert sender.flush(10)
    assert log.entries == [
        "publish 1",
        "deliver a",
        "deliver b",
        "deliver c",
        "publish 2",
        "publish 3",
        "deliver d",
    ]
    sender.stop()


def test_the_engine_is_held_back_only_when_max_pending_sends_wait() -> None:
    hold = threading.Event()
    log = Log(hold)
    sender = EventSender(log.publish, log.deliver, max_pending=2)
    sender.send(batch(1), None)
    assert log.publishing.wait(10)  # the first is on the wire (held there)
    sender.send(batch(2), None)  # the second waits: two pending, the caller returns at once
    third_sent = threading.Event()

    def third() -> None:
        sender.send(batch(3), None, (done("a"),))
        third_sent.set()

    t = threading.Thread(target=third)
    t.start()
    assert not third_sent.wait(0.2)  # a third waits for room
    assert not sender.idle and log.entries == []
    hold.set()
    assert third_sent.wait(10)
    t.join(10)
    assert sender.flush(10) and sender.idle
    assert log.entries == ["publish 1", "publish 2", "publish 3", "deliver a"]
    sender.stop()


def test_a_publish_that_raises_still_lets_its_outputs_out_and_the_sender_serves_on() -> None:
    delivered: list[str] = []

    def publish(events: EventBatch | None, notes: object) -> None:
        if events is not None and events.seq == 1:
            raise RuntimeError("a bug in encoding")

    sender = EventSender(publish, lambda rid, _o: delivered.append(rid))
    sender.send(batch(1), None, (done("a"),))
    sender.send(batch(2), None, (done("b"),))
    assert sender.flush(10)
    assert delivered == ["a", "b"]
    sender.stop()


def test_after_stop_a_send_runs_in_its_caller() -> None:
    delivered: list[tuple[str, int]] = []
    sender = EventSender(
        lambda e, n: None, lambda rid, _o: delivered.append((rid, threading.get_ident()))
    )
    sender.send(batch(1), None, (done("a"),))
    sender.stop()
    sender.send(batch(2), None, (done("b"),))
    caller = threading.get_ident()
    assert [rid for rid, _ in delivered] == ["a", "b"]
    assert delivered[0][1] != caller and delivered[1][1] == caller


def test_flush_times_out_while_a_publish_hangs() -> None:
    hold = threading.Event()
    log = Log(hold)
    sender = EventSender(log.publish, log.deliver)
    sender.send(batch(1), None)
    started = time.monotonic()
    assert not sender.flush(0.1)
    assert time.monotonic() - started < 10
    hold.set()
    assert sender.flush(10)
    sender.stop()


def test_max_pending_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        EventSender(lambda e, n: None, lambda r, o: None, max_pending=0)
