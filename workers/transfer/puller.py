"""The pulling side of a worker: its peers as pull sources, its transports, and each pull from the
plan a request arrives with to the request queued on the engine.

    submit --+--> engine: add_request (reserve) ---------------+--> engine: fill, finish_pull
             +--> Puller.begin: transport asks the source ------+    (one call; the step follows)

`begin` starts the pull before the request is reserved (the source needs only the plan); the
caller resolves the returned future with the reservation, or None when there is none (the plan
did not fit and the request recomputes, or the request was rejected).

A same-GPU pull from a peer whose cache is already mapped skips the loop: `admission` hands the
actor an `AdmissionPull`, which asks, reserves, writes and queues in the one engine call
(`admission_pull.py`); the first pull from a peer, NCCL and the object store go as above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any, TypeVar

import torch

from kvmesh.workers.contract.requests import PullSpec, Transport
from kvmesh.workers.engine.pull_admission import PullTiming
from kvmesh.workers.engine.worker import BlockWriter, PullTargets, Worker
from kvmesh.workers.kv.pull_reservation import PullReservation
from kvmesh.workers.transfer.admission_pull import AdmissionPull
from kvmesh.workers.transfer.cuda_ipc import CudaIpcTransport
from kvmesh.workers.transfer.nccl import NcclLink, NcclTransport
from kvmesh.workers.transfer.object_store import ObjectStoreTransport
from kvmesh.workers.transfer.peer_source import PeerSource
from kvmesh.workers.transfer.transport import fetch_planned

log = logging.getLogger(__name__)

T = TypeVar("T")
OnEngine = Callable[[Callable[[], T]], Awaitable[T]]


class Puller:
    """Invariant: every pull task is held in `_tasks`, and every unpin an admission's pull
    scheduled on the loop in `_unpins`, until it ends (the loop keeps only weak references);
    every pull whose request was reserved ends with the request queued (`finish_pull`) or failed
    through `fail`."""

    def __init__(
        self,
        worker: Worker,
        node_id: str,
        on_engine: OnEngine[Any],
        fail: Callable[[str, Exception], None],
        clock: Callable[[], float] = time.perf_counter,
        submit: Callable[[Callable[[], Any]], None] | None = None,
    ) -> None:
        self.worker = worker
        self.node_id = node_id
        self._clock = clock
        """Seconds; times each pull's parts (`PullTiming`)."""
        self._on_engine = on_engine
        self._submit = submit
        """Runs a closure on the engine thread without waiting (None: no pull within admission)."""
        self._fail = fail
        self._peers: dict[str, PeerSource] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unpins: set[futures.Future[None]] = set()
        self._object_store = ObjectStoreTransport(self.peer, worker.runner)
        self._cuda_ipc = CudaIpcTransport(self.peer, worker.runner)
        self._nccl: NcclTransport | None = None

    def peer(self, worker_id: str) -> PeerSource:
        return self._peers[worker_id]

    def set_peers(self, peers: dict[str, Any]) -> None:
        """The other workers' actor handles, by id. A peer whose actor is unchanged keeps its
        channel; the others' channels are closed."""
        old, self._peers = self._peers, {}
        for w, actor in peers.items():
            kept = old.pop(w, None)
            if kept is not None and _actor_id(kept.actor) == _actor_id(actor):
                self._peers[w] = kept
            else:
                self._peers[w] = PeerSource(actor, self.node_id)
                if kept is not None:
                    kept.close()
        for gone in old.values():
            gone.close()

    def join_nccl(self, link: NcclLink) -> None:
        self._nccl = NcclTransport(self.peer, self.worker.runner, link)

    def admission(self, spec: PullSpec) -> AdmissionPull | None:
        """The pull to run inside its request's admission on the engine thread
        (`admission_pull.py`): a same-GPU pull from a peer whose cache is mapped and whose
        channel is connected. None: `begin` it on the loop instead."""
        if spec.transport is not Transport.CUDA_IPC or self._submit is None:
            return None
        peer = self._peers.get(spec.source)
        peer_cache = self._cuda_ipc.mapped(spec.source)
        channel = peer.blocking_channel() if peer is not None else None
        if channel is None or peer_cache is None:
            return None
        loop = asyncio.get_running_loop()

        def release(ids: list[int], copied: list[torch.cuda.Event]) -> None:
            unpin = self._cuda_ipc.unpin_after(spec.source, ids, copied)
            future = asyncio.run_coroutine_threadsafe(unpin, loop)
            self._unpins.add(future)
            future.add_done_callback(self._unpinned)

        return AdmissionPull(
            self.worker, self._cuda_ipc, channel, peer_cache, spec, release, self._submit,
            self._fail, self._clock,
        )  # fmt: skip

    def _unpinned(self, future: futures.Future[None]) -> None:
        self._unpins.discard(future)
        failure = None if future.cancelled() else future.exception()
        if failure is not None:  # the source keeps the run pinned: say so, serve on
            log.warning("unpinning a pulled run failed: %s", failure)

    def begin(self, rid: str, spec: PullSpec) -> asyncio.Future[PullReservation | None]:
        """Start pulling `spec` for request `rid`; resolve the returned future with its
        reservation (or None) once the engine has reserved it."""
        reserved: asyncio.Future[PullReservation | None] = (
            asyncio.get_running_loop().create_future()
        )
        task = asyncio.create_task(self._pull(rid, spec, reserved))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return reserved

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()

    async def _pull(
        self, rid: str, spec: PullSpec, reserved: asyncio.Future[PullReservation | None]
    ) -> None:
        """Fill the request's reserved blocks from `spec.source` and queue the request, in one
        engine call; a failed pull means recompute. Without a reservation the request is already
        queued or gone: a transport that started still runs its writer, which must consume what
        the source sends."""
        started = self._clock()
        answered = started  # when the transport first had the source's answer to write
        finished = False
        failure: Exception | None = None

        def finish(written: int, write_began: float | None = None) -> None:
            nonlocal finished, failure
            finished = True
            try:
                timing = PullTiming.between(started, answered, write_began, self._clock())
                self.worker.finish_pull(rid, written, timing)
            except Exception as exc:
                failure = exc

        async def write(fill: BlockWriter) -> int:
            nonlocal answered
            answered = self._clock()
            reservation = await reserved

            def write_and_finish() -> int:
                if reservation is None:  # nothing of this request's to write into
                    return fill(PullTargets([]))
                began = self._clock()
                written = self.worker.write_pull(rid, fill)
                finish(written, began)  # queued: the engine steps it right after this call
                return written

            written: int = await self._on_engine(write_and_finish)
            return written

        written = 0
        try:
            written = await self._fetch(spec, write)
        except Exception as exc:  # a dead or confused peer: recompute what did not arrive
            why = (str(exc) or type(exc).__name__).splitlines()[0]
            log.warning("pull %s <- %s failed: %s", rid, spec.source, why)
        if not finished and await reserved is not None:
            await self._on_engine(lambda: finish(written))
        if failure is not None:  # the request cannot be queued: it ends here, not silently
            log.error("pull %s: finishing failed", rid, exc_info=failure)
            self._fail(rid, failure)

    async def _fetch(self, spec: PullSpec, write: Any) -> int:
        transports = {Transport.CUDA_IPC: self._cuda_ipc, Transport.NCCL: self._nccl}
        planned = transports.get(spec.transport)
        return await fetch_planned(planned, self._object_store, spec.source, spec.hashes, write)


def _actor_id(actor: Any) -> object:
    return getattr(actor, "_actor_id", id(actor))
