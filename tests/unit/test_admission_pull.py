"""A same-GPU pull inside its request's admission (`AdmissionPull`), on real CPU workers and a
real Unix-socket channel: the source is asked, the request reserved, the run written and the
request queued in one engine call; a late answer is written through the engine by a helper; a
channel in use is declined; a broken one means recompute; a rejected request's pin is released."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.contract.requests import PullSpec, Transport
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.transfer import peer_channel
from kvmesh.workers.transfer.admission_pull import ANSWER_WAIT_S, AdmissionPull
from kvmesh.workers.transfer.cuda_ipc import CudaIpcTransport
from kvmesh.workers.transfer.peer_channel import BlockingChannel, ChannelOp
from tests.unit.loop_thread import LoopThread
from tests.unit.test_transfer import PREFIX, chain_of, finish, make_worker, request, warm_peer


class ServedSource:
    """A warm worker answering pins and unpins on a Unix socket from its own event loop thread,
    as an actor does; `delay_s` holds each pin's answer back."""

    def __init__(self, worker: Worker, delay_s: float = 0.0) -> None:
        self.worker = worker
        self.delay_s = delay_s
        self.path = os.path.join(tempfile.mkdtemp(), "peer.sock")
        self._loop_thread = LoopThread()
        handlers = {ChannelOp.PIN: self._pin, ChannelOp.UNPIN: self._unpin}
        self.server = self._loop_thread.run(peer_channel.serve(self.path, handlers))  # type: ignore[arg-type]

    async def _pin(self, hashes: Sequence[int], _: int) -> list[int]:
        await asyncio.sleep(self.delay_s)
        return [int(b) for b in self.worker.pull_source.pin_run([BlockHash(h) for h in hashes])]

    async def _unpin(self, ids: Sequence[int], _: int) -> list[int]:
        self.worker.pull_source.unpin(list(ids))  # type: ignore[arg-type]
        return []

    def close(self) -> None:
        self._loop_thread.stop(self.server)


class DeadSource:
    """A source that accepts a channel and dies: the connection closes unanswered."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(), "dead.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen()
        self._thread = threading.Thread(target=self._die, daemon=True)
        self._thread.start()

    def _die(self) -> None:
        connection, _ = self._listener.accept()
        connection.close()
        self._listener.close()

    def wait_dead(self) -> None:
        """Until the connection made to it has been closed."""
        self._thread.join(timeout=10)


class Admission:
    """An `AdmissionPull` from `source` into `target` with what the puller gives it: the
    closures the engine thread would run later (`submitted`), runs to release (`released`),
    failures."""

    def __init__(
        self, target: Worker, source: ServedSource | DeadSource, prompt: list[int]
    ) -> None:
        self.target = target
        self.channel = BlockingChannel(source.path)
        peer_cache = source.worker.runner.kv_cache if isinstance(source, ServedSource) else None
        self.submitted: list[Callable[[], Any]] = []
        self.released: list[list[int]] = []
        self.failures: list[str] = []
        self.spec = PullSpec("peer", 0, tuple(chain_of(target, prompt)[:6]), Transport.CUDA_IPC)
        transport = CudaIpcTransport(lambda _: None, target.runner)  # type: ignore[arg-type,return-value]
        self.pull = AdmissionPull(
            target,
            transport,
            self.channel,
            peer_cache if peer_cache is not None else target.runner.kv_cache,
            self.spec,
            lambda ids, _copied: self.released.append(ids),
            self.submitted.append,
            lambda rid, exc: self.failures.append(rid),
        )

    def unpin_released(self, source: Worker) -> None:
        for ids in self.released:
            source.pull_source.unpin(ids)  # type: ignore[arg-type]
        source.check_invariants()


@pytest.fixture
def source() -> Any:
    served = ServedSource(warm_peer())
    yield served
    served.close()


def test_the_pull_lands_and_the_request_is_queued_in_the_admitting_call(
    source: ServedSource,
) -> None:
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    admission = Admission(target, source, prompt)
    assert admission.pull.admit(request("req", prompt, pull=admission.spec), time.monotonic())
    assert target.has_work and admission.submitted == []  # queued, nothing left for later
    assert admission.released == [source.worker.pool.match_prefix(admission.spec.hashes)]
    facts = finish(target, "req")[0].prefill
    assert facts is not None and (facts.pulled_tokens, facts.computed_tokens) == (96, 2)
    assert target.tally.num_pulls_in_admission == 1
    admission.unpin_released(source.worker)
    assert source.worker.pull_source.held_blocks() == []
    target.check_invariants()


def test_a_late_answer_is_written_through_the_engine_by_a_helper() -> None:
    served = ServedSource(warm_peer(), delay_s=10 * ANSWER_WAIT_S)
    try:
        target, _ = make_worker("target")
        prompt = PREFIX + [7, 7]
        admission = Admission(target, served, prompt)
        assert admission.pull.admit(request("req", prompt, pull=admission.spec), time.monotonic())
        assert not target.has_work  # reserved, waiting for its blocks
        deadline = time.monotonic() + 10
        while not admission.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(admission.submitted) == 1
        admission.submitted[0]()  # the engine thread's turn
        facts = finish(target, "req")[0].prefill
        assert facts is not None and facts.pulled_tokens == 96
        admission.unpin_released(served.worker)
        assert served.worker.pull_source.held_blocks() == []
    finally:
        served.close()


def test_a_channel_serving_another_pull_is_declined(source: ServedSource) -> None:
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    admission = Admission(target, source, prompt)
    assert admission.channel.try_take()
    assert not admission.pull.admit(request("req", prompt, pull=admission.spec), 0.0)
    assert not target.has_work and target.info().num_waiting == 0  # nothing done: the loop's turn
    admission.channel.give_back()


def test_a_broken_channel_means_recompute(source: ServedSource) -> None:
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    admission = Admission(target, source, prompt)
    admission.channel.close()
    assert not admission.pull.admit(request("req", prompt, pull=admission.spec), 0.0)
    dead_source = DeadSource()
    dead = Admission(target, dead_source, prompt)
    dead_source.wait_dead()
    assert dead.pull.admit(request("req", prompt, pull=dead.spec), time.monotonic())
    assert dead.channel.broken and dead.released == []
    facts = finish(target, "req")[0].prefill
    assert facts is not None and (facts.pulled_tokens, facts.computed_tokens) == (0, 98)
    target.check_invariants()


def test_a_rejected_request_still_releases_what_the_source_pinned(source: ServedSource) -> None:
    target, _ = make_worker("target")
    prompt = PREFIX + [7, 7]
    admission = Admission(target, source, prompt)
    bad = request("req", PREFIX + [10**6], pull=admission.spec)  # outside the vocabulary
    with pytest.raises(ValueError, match="vocabulary"):
        admission.pull.admit(bad, 0.0)
    deadline = time.monotonic() + 10
    while not admission.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [len(ids) for ids in admission.released] == [6]
    admission.unpin_released(source.worker)
    assert source.worker.pull_source.held_blocks() == []
