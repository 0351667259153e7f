"""The request channel over a real Unix socket: the worker's end (`workers/request_channel.py`)
on an asyncio loop, the coordinator's (`SideDoor`) on blocking sockets. A submit is answered
with its own outcome, the stream's batches arrive in order, an abort reaches the worker, the
coordinator's hang-up ends the stream on the worker, the worker's end fails every waiting
submit, and a connection that sends garbage is dropped while others are served."""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import struct
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvmesh.coordinator.cluster.side_door import SideDoor, SideDoorClosed
from kvmesh.workers import request_channel
from kvmesh.workers.contract.replies import RequestOutput, RequestRejected
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.request_channel import BadFrame, Frame, RequestHandlers
from tests.unit.loop_thread import LoopThread


class Worker:
    """Handlers as the actor answers them, on the server's loop: a submit of a prompt starting
    with 0 is rejected, one starting with 9 waits for `release`; each accepted request gets one
    finished output with its prompt reversed; the stream's end is recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.submitted: list[WorkerRequest] = []
        self.aborted: list[str] = []
        self.closed_streams: list[str] = []
        self.release = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[list[Any]]] = {}

    async def submit(self, request: WorkerRequest) -> None:
        if request.prompt_ids[0] == 0:
            raise RequestRejected(f"no room for {request.request_id}")
        if request.prompt_ids[0] == 9:
            await self.release.wait()
        self.submitted.append(request)
        output = RequestOutput(request.request_id, request.prompt_ids[::-1], True, "length")
        await self._queues[request.reply_to].put([(request.request_id, output)])

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def outputs(self, stream_id: str) -> AsyncIterator[list[Any]]:
        q: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._queues[stream_id] = q
        try:
            yield []
            while True:
                yield await q.get()
        finally:
            self.closed_streams.append(stream_id)


class Served:
    """A `Worker` served on a loop in a background thread."""

    def __init__(self) -> None:
        self._loop_thread = LoopThread()
        self.loop = self._loop_thread.loop
        self.path = os.path.join(tempfile.mkdtemp(), "requests.sock")
        self.worker = Worker(self.loop)
        handlers = RequestHandlers(self.worker.submit, self.worker.abort, self.worker.outputs)
        self.server = self.on_loop(request_channel.serve(self.path, handlers))

    def on_loop(self, coro: Any) -> Any:
        return self._loop_thread.run(coro)

    def stop(self) -> None:
        self._loop_thread.stop(self.server)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


class Reader:
    """The door's one reader (as `OutputReader`'s thread): batches into a queue; submits are
    answered only while it reads."""

    def __init__(self, door: SideDoor) -> None:
        self.batches: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(door,), daemon=True)
        self._thread.start()

    def _run(self, door: SideDoor) -> None:
        for batch in door.batches():
            self.batches.put(batch)
        self.batches.put(None)  # the door ended

    def next(self) -> list[Any] | None:
        return self.batches.get(timeout=10)

    def join(self) -> bool:
        self._thread.join(timeout=10)
        return not self._thread.is_alive()


def request(rid: str, *prompt: int) -> WorkerRequest:
    return WorkerRequest(rid, tuple(prompt), SamplingConfig(4))


def wait_until(predicate: Any) -> None:
    for _ in range(500):
        if predicate():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition not reached")


def test_submits_get_their_own_outcomes_and_the_stream_its_batches(served: Served) -> None:
    door = SideDoor.connect(served.path, "coordinator/a")
    reader = Reader(door)
    assert reader.next() == []  # open
    ok = door.submit(request("r1", 3, 4, 5))
    rejected = door.submit(request("r2", 0, 1))
    assert ok.result(timeout=5) is None
    with pytest.raises(RequestRejected, match="no room for r2"):
        rejected.result(timeout=5)
    [(rid, output)] = reader.next() or []
    assert rid == "r1" and output.new_token_ids == (5, 4, 3) and output.finished
    # The worker's submit saw the request replying to this connection's stream.
    assert [r.reply_to for r in served.worker.submitted] == ["coordinator/a"]
    assert door.abort("r1")
    wait_until(lambda: served.worker.aborted == ["r1"])
    door.close()
    assert reader.next() is None and reader.join()


def test_a_coordinator_that_hangs_up_ends_its_stream_on_the_worker(served: Served) -> None:
    door = SideDoor.connect(served.path, "coordinator/b")
    reader = Reader(door)
    assert reader.next() == []
    door.close()
    assert reader.next() is None and reader.join()
    wait_until(lambda: served.worker.closed_streams == ["coordinator/b"])
    assert door.submit(request("late", 1)).exception(timeout=5) is not None
    assert not door.abort("late")


def test_the_workers_end_fails_every_waiting_submit(served: Served) -> None:
    door = SideDoor.connect(served.path, "coordinator/c")
    reader = Reader(door)
    assert reader.next() == []
    waiting = door.submit(request("slow", 9))  # answered only after `release`

    async def drop_everything() -> None:
        served.server.close()  # the worker's process ending, as the socket sees it
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    served.on_loop(drop_everything())
    assert reader.next() is None and reader.join()
    with pytest.raises(SideDoorClosed):
        waiting.result(timeout=5)
    assert door.ended
    with pytest.raises(SideDoorClosed):
        door.submit(request("after", 1)).result(timeout=5)


def test_garbage_drops_that_connection_and_others_are_served(served: Served) -> None:
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(served.path)
    raw.sendall(struct.pack("<I", 5) + b"junk!")  # not a pickle
    assert raw.recv(1) == b""  # dropped
    raw.close()
    door = SideDoor.connect(served.path, "coordinator/d")
    reader = Reader(door)
    assert reader.next() == []
    assert door.submit(request("r", 1, 2)).result(timeout=5) is None
    door.close()
    assert reader.join()


def test_frames_round_trip_and_bad_ones_are_refused() -> None:
    data = request_channel.encode(Frame.ABORT, "r9")
    assert request_channel.decode(data[4:]) == (Frame.ABORT, "r9")
    with pytest.raises(BadFrame):
        request_channel.decode(b"not a pickle")
    import pickle

    with pytest.raises(BadFrame):
        request_channel.decode(pickle.dumps((99, "x")))  # no such frame
    with pytest.raises(BadFrame):
        request_channel.decode(pickle.dumps(["OPEN"]))
    left, right = socket.socketpair()
    left.sendall(struct.pack("<I", request_channel.MAX_FRAME_BYTES + 1))
    with pytest.raises(BadFrame, match="exceeds"):
        request_channel.recv_frame(right)
    left.close()
    assert request_channel.recv_frame(right) is None  # the peer's end
    right.close()


def test_an_exception_that_does_not_pickle_goes_back_as_its_text() -> None:
    class Local(Exception):  # a local class cannot be pickled
        pass

    sent = request_channel.picklable(Local("boom"))
    assert isinstance(sent, RuntimeError) and "Local: boom" in str(sent)
    rejected = RequestRejected("kept")
    assert request_channel.picklable(rejected) is rejected
