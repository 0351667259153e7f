"""The Ray shell around `Worker`: the one module that imports ray.

One engine thread owns the worker (pool, scheduler, model) and drives `Worker.step()`
(`workers/engine_thread.py`); Ray's event loop serves calls. Anything that touches the worker
runs on the engine thread as a closure (`_on_engine`), but a same-GPU peer's pin and unpin, which
take the worker's state lock (`_with_state`) so they need not wait out a step. A coordinator sends
requests with `submit` and reads every output of its requests from one stream (`outputs`), a
batch per message (`OutputBatches`); each request names the stream its outputs go to
(`WorkerRequest.reply_to`; `OutputStreams` keeps which is which). After every step the engine
thread hands out first and middle tokens, publishes the step's KV events, then hands out the
requests' last outputs, so by the time a client sees a request end the index already knows the
blocks it left behind.

    coordinator --submit(req)--> [pull: reserve | ask the source, write, finish] --> engine:
                <--outputs()---  step, tokens, publish events, last outputs --> OutputBatches

A request with a pull plan is pulled here, by the worker that serves it, while it is admitted
(`workers/transfer/puller.py`): the reserved blocks belong to the request from the start. As a
pull source the actor answers its peers' calls over Ray, and those on its node also over its
Unix-socket channel (`channel_address`). A coordinator on its node submits, aborts and reads its
stream through the request channel (`request_channel_address`), the same methods without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers import request_channel
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestOutput, RequestRejected, WorkerFailed, WorkerInfo
from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.engine.event_publisher import EventPublisher
from kvmesh.workers.engine_thread import EngineThread
from kvmesh.workers.model.loader import build_worker
from kvmesh.workers.output_batches import BatchItem
from kvmesh.workers.output_streams import OutputStreams
from kvmesh.workers.request_channel import RequestHandlers
from kvmesh.workers.side_doors import SideDoors
from kvmesh.workers.transfer import peer_channel
from kvmesh.workers.transfer.block_export import BlockExport
from kvmesh.workers.transfer.nccl import NcclLink, serve_send
from kvmesh.workers.transfer.peer_channel import ChannelOp
from kvmesh.workers.transfer.puller import Puller

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerActor:
    """Ray actor: create with `ray.remote(...)(WorkerActor).options(...).remote(config)`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker = build_worker(config)
        if self.worker.device.startswith("cuda") and ray.get_gpu_ids():
            # Label the device by the GPU Ray gave us (every actor sees its own as cuda:0), so
            # the coordinator can tell workers sharing a GPU from workers on different GPUs.
            self.worker.device = f"cuda:{ray.get_gpu_ids()[0]}"
        self._node_id = ray.get_runtime_context().get_node_id()
        self.worker.node = f"{self.worker.node}/{self._node_id[:12]}"
        self._outputs = OutputStreams()
        publisher = (
            EventPublisher(config.redis_url, self.worker.namespace, config.worker_id)
            if config.redis_url
            else None
        )
        if publisher is not None:
            # A worker started after a ClearCache hashes under the epoch the fleet is at.
            self.worker.cache_epoch = publisher.cache_epoch() or 0
        self._engine = EngineThread(
            self.worker,
            config,
            publisher,
            self._deliver,
            self._fail_all,
            hand_over=self._outputs.wait_taken,
        )
        self._submit = self._engine.submit
        self._on_engine = self._engine.on_engine
        self._puller = Puller(
            self.worker, self._node_id, self._on_engine, self._fail_pull, submit=self._submit
        )
        self._doors = SideDoors(config.worker_id)
        self._nccl_link: NcclLink | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._engine.start()

    # ---- requests -----------------------------------------------------------------------------

    async def submit(self, request: WorkerRequest) -> None:
        """Accept a request; its outputs go out on the `outputs` stream it names (`reply_to`).
        Raises RequestRejected for a request this worker cannot run. A same-GPU pull from a peer
        already mapped runs inside the request's admission on the engine thread
        (`admission_pull.py`); any other pull runs in the background, its source asked while the
        request is still being reserved. Either way the request is admitted once the blocks land
        (or, failed, recomputes)."""
        rid = request.request_id
        accepted = self.worker.clock()  # before the wait for the engine's step in progress
        self._outputs.route(rid, request.reply_to)
        pull = request.pull if not request.bypass_cache else None
        admission = self._puller.admission(pull) if pull is not None else None
        reserved = None
        reservation = None
        try:
            if admission is not None and await self._on_engine(
                lambda: admission.admit(request, accepted)
            ):
                self._engine.wake()
                return
            if pull is not None:
                reserved = self._puller.begin(rid, pull)
            reservation = await self._on_engine(lambda: self.worker.add_request(request, accepted))
        except BaseException as exc:
            self._outputs.unroute(rid)
            if isinstance(exc, ValueError):
                raise RequestRejected(str(exc)) from None
            raise
        finally:
            if reserved is not None:
                reserved.set_result(reservation)
        self._engine.wake()

    async def outputs(self, stream_id: str) -> AsyncIterator[list[BatchItem]]:
        """Every output of the requests submitted with `reply_to=stream_id`, a batch at a time,
        for as long as the caller reads. When the caller goes away (it closed the stream, or it
        died), its requests are aborted: nothing computes for a reader that is gone. The first
        batch is empty: it tells the reader the stream is open."""
        batches = self._outputs.open(stream_id, asyncio.get_running_loop())
        try:
            yield []  # open: the reader submits requests naming this stream only after this
            while True:
                yield await batches.take()
        finally:
            for rid in self._outputs.close(stream_id):
                self._submit(lambda rid=rid: self.worker.abort(rid))  # type: ignore[misc]

    def abort(self, request_id: str) -> None:
        """Stop a request (its caller went away); its stream gets nothing more for it."""
        self._outputs.unroute(request_id)
        self._submit(lambda: self.worker.abort(request_id))

    def set_peers(self, peers: dict[str, Any]) -> None:
        """The other workers' actor handles, by id (pull sources)."""
        self._puller.set_peers({w: a for w, a in peers.items() if w != self.config.worker_id})

    async def channel_address(self) -> tuple[str, str] | None:
        """(node id, Unix socket path) where a peer on this node makes a pull's small calls to
        this worker (`PeerChannel`); served from the first ask on."""
        handlers: dict[ChannelOp, peer_channel.Handler] = {
            ChannelOp.PIN: lambda hashes, _: self.pin_blocks(list(hashes)),
            ChannelOp.UNPIN: self._unpin_over_channel,
            ChannelOp.NCCL_ACCEPT: lambda hashes, rank: self.nccl_accept(list(hashes), rank),
        }
        path = await self._doors.open("peers", lambda p: peer_channel.serve(p, handlers))
        return self._node_id, path

    async def request_channel_address(self) -> tuple[str, str] | None:
        """(node id, Unix socket path) where a coordinator on this node submits requests and
        reads its output stream (`workers/request_channel.py`); served from the first ask on."""
        handlers = RequestHandlers(self.submit, self.abort, self.outputs)
        path = await self._doors.open("requests", lambda p: request_channel.serve(p, handlers))
        return self._node_id, path

    async def _unpin_over_channel(self, ids: Sequence[int], _: int) -> list[int]:
        await self.unpin_blocks(list(ids))
        return []

    # ---- reports and admin ----------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        info = self.worker.info()
        busy = info.num_running + info.num_waiting > 0
        stalled = time.monotonic() - self._engine.last_tick if busy else 0.0
        return replace(info, engine_stalled_s=stalled)

    def ping(self) -> str:
        return self.config.worker_id

    async def clear_cache(self, cache_epoch: int | None = None) -> int:
        def clear() -> int:
            dropped = self.worker.clear_cache(cache_epoch)
            self._engine.publish(self.worker.full_state_batch())
            return dropped

        return await self._on_engine(clear)

    async def check_invariants(self) -> bool:
        await self._on_engine(self.worker.check_invariants)
        return True

    async def cached_hashes(self) -> list[int]:
        return await self._on_engine(lambda: [int(h) for h in self.worker.pool.cached_hashes()])

    # ---- pull sources (a peer's transport calls these) ------------------------------------------

    async def export_blocks(self, hashes: list[int]) -> BlockExport:
        """The leading run of `hashes` this worker holds, as one CPU tensor (object store)."""
        run = [BlockHash(h) for h in hashes]
        return await self._on_engine(lambda: self.worker.pull_source.export_blocks(run))

    def ipc_handle(self) -> tuple[Any, Any] | None:
        """What a worker on the same GPU needs to map this worker's KV cache (CUDA IPC)."""
        cache = self.worker.runner.kv_cache
        return reduce_tensor(cache) if cache.is_cuda else None

    async def pin_blocks(self, hashes: list[int]) -> list[int]:
        """Pin the leading run of `hashes` for a peer that copies it in place (CUDA IPC), under
        the state lock: served while a step's forward runs, not after the step."""
        run = [BlockHash(h) for h in hashes]
        pinned = await self._with_state(lambda: self.worker.pull_source.pin_run(run))
        return [int(b) for b in pinned]

    async def unpin_blocks(self, ids: list[int]) -> None:
        await self._with_state(lambda: self.worker.pull_source.unpin(ids))  # type: ignore[arg-type]

    async def _with_state(self, fn: Callable[[], T]) -> T:
        """Run a short call on the worker's state under its lock, not behind the engine's step:
        at once when the lock is free (the engine between steps' phases, or in a forward pass),
        else on a helper thread that waits for it, so the event loop never blocks."""
        lock = self._engine.lock
        ran, result = lock.try_run(fn)
        if ran:
            return cast(T, result)
        return await asyncio.to_thread(lock.run, fn)

    def nccl_init(self, init_method: str, ranks: dict[str, int]) -> int:
        """Join the workers' NCCL group (one rank per GPU) for GPU-to-GPU pulls."""
        import torch.distributed as dist  # only multi-GPU deployments need it

        rank = ranks[self.config.worker_id]
        torch.cuda.set_device(self.worker.runner.kv_cache.device)
        dist.init_process_group("nccl", init_method=init_method, world_size=len(ranks), rank=rank)
        self._nccl_link = NcclLink(rank, ranks)
        self._puller.join_nccl(self._nccl_link)
        return rank

    def nccl_group(self) -> dict[str, int]:
        """The NCCL group this worker joined (worker id -> rank), empty if none: how a
        coordinator that did not start the workers learns which pulls can go over NCCL."""
        return dict(self._nccl_link.ranks) if self._nccl_link is not None else {}

    def nccl_warm_up(self) -> int:
        """Build the NCCL communicator with every peer now, not on the first pull (all ranks
        call this together, after `nccl_init`)."""
        assert self._nccl_link is not None, "nccl_warm_up before nccl_init"
        return self._nccl_link.warm_up_pairs()

    async def nccl_accept(self, hashes: list[int], dst_rank: int) -> list[int] | None:
        """Agree to send the leading device run of `hashes` to `dst_rank`: pin it, answer with
        its block ids and start the send (`serve_send`: it completes once the puller receives;
        then the run is unpinned and the claim let go). None if this worker is in another NCCL
        transfer."""
        link = self._nccl_link
        if link is None or not link.try_claim():
            return None
        run = [BlockHash(h) for h in hashes]
        try:
            # On the engine thread, not under the state lock: the send itself is queued there
            # (NCCL calls stay on one thread), and a pull accepted while this engine is in a
            # step would hold the puller's forward waiting for the step's end.
            pinned = await self._on_engine(lambda: self.worker.pull_source.pin_run(run))
        except BaseException:
            link.release()
            raise
        ids = [int(b) for b in pinned]
        if not ids:
            link.release()
            return ids
        cache = self.worker.runner.kv_cache

        def unpin() -> None:
            self.worker.pull_source.unpin(ids)  # type: ignore[arg-type]

        task = asyncio.create_task(serve_send(link, cache, ids, dst_rank, self._on_engine, unpin))
        self._sends.add(task)  # the loop keeps only weak references to its tasks
        task.add_done_callback(self._sends.discard)
        return ids

    def make_probe(self, num_bytes: int) -> torch.Tensor:
        """A tensor of `num_bytes` for measuring a link at start-up."""
        return torch.ones(num_bytes, dtype=torch.uint8)

    def consume_probe(self, probe: torch.Tensor) -> int:
        return int(probe.numel())

    def shutdown(self) -> None:
        self._puller.close()
        self._doors.close()
        self._engine.stop()
        if self._engine.publisher is not None:
            self._engine.publisher.close()

    def _fail_pull(self, request_id: str, exc: Exception) -> None:
        self._submit(lambda: self.worker.abort(request_id))
        self._deliver(request_id, WorkerFailed(f"worker {self.config.worker_id} failed: {exc}"))
        self._engine.wake()

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        self._outputs.deliver(request_id, item)

    def _fail_all(self, exc: Exception) -> None:
        ids = self._outputs.routed()
        for rid in ids:
            self.worker.abort(rid)
            self._deliver(rid, WorkerFailed(f"worker {self.config.worker_id} failed: {exc}"))


def remote_worker_class(num_gpus: float, num_cpus: float = 1) -> Any:
    """The actor class with its resources; callers then use `.options(name=...).remote(config)`."""
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=0)(WorkerActor)
