"""A same-GPU pull run inside its request's admission, on the engine thread: the source is asked
over its channel's blocking end just before the request is reserved, and its answer is read, the
copy enqueued and the blocks registered in the same engine call, so the request is queued with
no hop through the event loop on the way.

    engine:  send pin | add_request: reserve | wait (lock let go) | copy, register -> queued
    source:             pin under its state lock -> answer

Through the loop (`puller.py`'s path, which every other pull takes) the answer waited for the
actor's own Ray work after the reservation, and the write ran beside it: on an H100 host the
request reached its step ~3.9 ms after it arrived, ~1.3 ms of it in those hand-offs.

The engine waits for the answer at most `ANSWER_WAIT_S` (2 ms), with the state lock let go so that
a peer pulling from this worker meanwhile is served; a later answer is read by a helper thread,
which queues the write on the engine as the loop's path would. A channel that breaks means
recompute, and the next pulls from that source go through the loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvmesh.workers.contract.requests import PullSpec, WorkerRequest
from kvmesh.workers.engine.pull_admission import BlockWriter, PullTiming
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.transfer.peer_channel import BlockingChannel, ChannelError, ChannelOp

log = logging.getLogger(__name__)

ANSWER_WAIT_S = 0.002
"""How long the engine waits for the source's answer before a helper thread takes over the
read; the worker's running requests wait with it, so this bounds what a slow source costs them.
Measured on an H100 host: the answer came 0.3-0.6 ms after the ask, within the ~0.6 ms the
reservation takes (the pull's whole source part 0.9-1.2 ms, the reservation included); a source
whose loop is busy answers later, and the engine steps on meanwhile."""


class RunWriter(Protocol):
    """What copies a pinned run of the source's cache in place (`CudaIpcTransport`)."""

    def writer(
        self, peer_cache: torch.Tensor, ids: list[int], copied: list[torch.cuda.Event]
    ) -> BlockWriter: ...


Release = Callable[[list[int], list[torch.cuda.Event]], None]
"""Lets the source unpin a run once the GPU has passed the given copies out of it."""


class AdmissionPull:
    """One request's same-GPU pull within its admission.

    Invariant: `admit` owns the channel from the ask until the answer is read (by the engine or
    the helper thread), then gives it back; every run the source pinned is released, and every
    reserved request ends with `finish_pull` or `fail`.
    """

    def __init__(
        self,
        worker: Worker,
        transport: RunWriter,
        channel: BlockingChannel,
        peer_cache: torch.Tensor,
        spec: PullSpec,
        release: Release,
        submit: Callable[[Callable[[], Any]], None],
        fail: Callable[[str, Exception], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._worker = worker
        self._transport = transport
        self._channel = channel
        self._peer_cache = peer_cache
        self._spec = spec
        self._release = release
        self._submit = submit
        """Runs a closure on the engine thread, before its next step."""
        self._fail = fail
        self._clock = clock

    def admit(self, request: WorkerRequest, accepted_s: float) -> bool:
        """On the engine thread: ask the source, add the request, write what the source pinned
        and queue the request. False (nothing done) when the channel is broken or serves another
        pull: the caller takes the loop's path instead."""
        if not self._channel.try_take():
            return False
        started = self._clock()
        rid = request.request_id
        try:
            self._channel.send(ChannelOp.PIN, self._spec.hashes)
        except ChannelError as exc:
            self._channel.give_back()
            log.warning("pull %s <- %s: the channel broke, recomputing: %s", rid, self._source, exc)
            if self._worker.add_request(request, accepted_s) is not None:
                self._finish(rid, 0, started, started, None)
            return True
        try:
            reserved = self._worker.add_request(request, accepted_s) is not None
        except BaseException:
            self._answer_later(rid, False, started)  # the source pinned a run all the same
            raise
        try:
            with self._lock_let_go():
                answered = self._channel.answered_within(ANSWER_WAIT_S)
        except ChannelError:
            answered = True  # broken: the read below says so at once
        if answered:
            self._write(rid, reserved, started, self._read_answer(rid))
        else:
            self._answer_later(rid, reserved, started)
        return True

    @property
    def _source(self) -> str:
        return self._spec.source

    def _lock_let_go(self) -> contextlib.AbstractContextManager[None]:
        lock = self._worker.state_lock
        return lock.released() if lock is not None else contextlib.nullcontext()

    def _read_answer(self, rid: str) -> list[int]:
        """The pinned run's block ids (none when the channel broke); gives the channel back."""
        try:
            return self._channel.receive() or []
        except ChannelError as exc:
            log.warning("pull %s <- %s failed, recomputing: %s", rid, self._source, exc)
            return []
        finally:
            self._channel.give_back()

    def _answer_later(self, rid: str, reserved: bool, started: float) -> None:
        def read() -> None:
            ids = self._read_answer(rid)
            if reserved:
                self._submit(lambda: self._write(rid, True, started, ids))
            elif ids:
                self._release(ids, [])

        threading.Thread(target=read, name=f"kvmesh-pull-{rid}", daemon=True).start()

    def _write(self, rid: str, reserved: bool, started: float, ids: list[int]) -> None:
        """On the engine thread, with the state lock: copy what the source pinned into the
        request's reserved blocks, register them and queue the request."""
        answered = self._clock()
        copied: list[torch.cuda.Event] = []
        written = 0
        try:
            if reserved and ids:
                writer = self._transport.writer(self._peer_cache, ids, copied)
                written = self._worker.write_pull(rid, writer)
        except Exception as exc:  # a confused peer: recompute what did not arrive
            log.warning("pull %s <- %s failed: %s", rid, self._source, exc)
        finally:
            if ids:
                self._release(ids, copied)
        if reserved:
            self._finish(rid, written, started, answered, answered)

    def _finish(
        self, rid: str, written: int, started: float, answered: float, write_began: float | None
    ) -> None:
        timing = PullTiming.between(started, answered, write_began, self._clock())
        try:
            self._worker.finish_pull(rid, written, timing)
        except Exception as exc:  # the request cannot be queued: it ends here, not silently
            log.error("pull %s: finishing failed", rid, exc_info=exc)
            self._fail(rid, exc)
            return
        self._worker.tally.num_pulls_in_admission += 1
