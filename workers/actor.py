"""The Ray shell around `Worker`: the one module that imports ray.

One engine thread drives `Worker.step()`; Ray's event loop serves calls. A request's outputs cross
from the engine thread to the caller's stream through an asyncio queue. After every step the
thread publishes the step's KV events *before* handing out the tokens, so by the time a client sees
a response the index already knows the blocks it left behind.

    caller --generate()--> inbox --engine thread: step, publish events--> queue --> stream
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import asdict
from typing import Any

import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.engine.event_publisher import EventPublisher
from kvmesh.workers.engine.failure import SequenceFailure
from kvmesh.workers.engine.worker import RequestOutput, WorkerRequest
from kvmesh.workers.model.loader import build_worker
from kvmesh.workers.transfer.block_copy import copy_blocks
from kvmesh.workers.transfer.links import BlockExport

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class RequestError(Exception):
    """A request the worker refused (bad input); the message is for the client."""


class WorkerActor:
    """Ray actor: create with `ray.remote(...)(WorkerActor).options(...).remote(config)`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker = build_worker(config)
        if self.worker.device.startswith("cuda") and ray.get_gpu_ids():
            # Label the device by the GPU Ray gave us (every actor sees its own as cuda:0), so
            # the coordinator can tell workers sharing a GPU from workers on different GPUs.
            self.worker.device = f"cuda:{ray.get_gpu_ids()[0]}"
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._publisher = (
            EventPublisher(config.redis_url, self.worker.namespace, config.worker_id)
            if config.redis_url
            else None
        )
        self._last_heartbeat = 0.0
        self._peer_caches: dict[str, torch.Tensor] = {}  # same-GPU peers' KV, mapped by CUDA IPC
        self._heartbeat()
        self._thread = threading.Thread(target=self._engine_loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # ---- Ray-facing methods -------------------------------------------------------------------

    async def generate(self, request: WorkerRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._streams[request.request_id] = (loop, out)
        self._inbox.put(("add", request))
        self._wakeup.set()
        try:
            while True:
                item = await out.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                live = self._streams.pop(request.request_id, None)
            if live is not None:
                # The caller went away before the end: stop computing for it.
                self._inbox.put(("abort", request.request_id))
                self._wakeup.set()

    def info(self) -> dict[str, Any]:
        return asdict(self.worker.info())

    def ping(self) -> str:
        return self.config.worker_id

    async def clear_cache(self) -> int:
        return int(await self._engine_call("clear", None))

    async def check_invariants(self) -> bool:
        return bool(await self._engine_call("check", None))

    async def cached_hashes(self) -> list[int]:
        return list(await self._engine_call("hashes", None))

    async def export_blocks(self, hashes: list[int]) -> BlockExport:
        """The leading run of `hashes` this worker holds, as one CPU tensor (object store)."""
        return await self._engine_call("export", hashes)  # type: ignore[no-any-return]

    async def import_blocks(self, export: BlockExport, parent: int) -> int:
        """Install a peer's exported run; returns how many of its blocks are now held here."""
        return int(await self._engine_call("import", (export, parent)))

    def ipc_handle(self) -> tuple[Any, Any] | None:
        """What a worker on the same GPU needs to map this worker's KV cache (CUDA IPC)."""
        cache = self.worker.runner.kv_cache
        return reduce_tensor(cache) if cache.is_cuda else None

    async def pin_blocks(self, hashes: list[int]) -> list[int]:
        return [int(b) for b in await self._engine_call("pin", hashes)]

    async def unpin_blocks(self, ids: list[int]) -> None:
        await self._engine_call("unpin", ids)

    async def import_from_peer(
        self, peer_id: str, handle: tuple[Any, Any], ids: list[int], hashes: list[int], parent: int
    ) -> int:
        """Same-GPU pull: copy `ids` of the peer's cache (mapped once per peer) into our pool."""
        return int(await self._engine_call("import_ipc", (peer_id, handle, ids, hashes, parent)))

    def nccl_init(self, init_method: str, world_size: int, rank: int) -> int:
        """Join the workers' NCCL group (one rank per GPU) for GPU-to-GPU pulls."""
        import torch.distributed as dist  # only multi-GPU deployments need it

        torch.cuda.set_device(self.worker.runner.kv_cache.device)
        dist.init_process_group("nccl", init_method=init_method, world_size=world_size, rank=rank)
        return rank

    async def nccl_send(self, ids: list[int], dst_rank: int) -> int:
        """Send pinned blocks (from `pin_blocks`) to `dst_rank`, then unpin them."""
        return int(await self._engine_call("nccl_send", (ids, dst_rank)))

    async def nccl_recv(
        self, num_blocks: int, src_rank: int, hashes: list[int], parent: int, source: str
    ) -> int:
        """Receive `num_blocks` from `src_rank` and install them under `hashes`."""
        args = (num_blocks, src_rank, hashes, parent, source)
        return int(await self._engine_call("nccl_recv", args))

    def make_probe(self, num_bytes: int) -> torch.Tensor:
        """A tensor of `num_bytes` for measuring a link at start-up."""
        return torch.ones(num_bytes, dtype=torch.uint8)

    def consume_probe(self, probe: torch.Tensor) -> int:
        return int(probe.numel())

    async def _engine_call(self, kind: str, arg: Any) -> Any:
        """Run an operation on the engine thread (which owns the pool) and await its result."""
        reply: futures.Future[Any] = futures.Future()
        self._inbox.put((kind, (arg, reply)))
        self._wakeup.set()
        return await asyncio.wrap_future(reply)

    def shutdown(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        self._thread.join(timeout=5)
        if self._publisher is not None:
            self._publisher.close()

    # ---- engine thread ------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self._drain_inbox()
                outputs = self.worker.step() if self.worker.has_work else []
                self._publish_events()
                for o in outputs:
                    self._deliver(o.request_id, o)
                if time.monotonic() - self._last_heartbeat >= self.config.heartbeat_interval_s:
                    self._heartbeat()
                if not outputs and not self.worker.has_work:
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
            except Exception as exc:  # keep serving: fail the running requests, not the worker
                log.exception("engine step failed")
                self._fail_all(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.worker.add_request(arg)
                except ValueError as exc:
                    self._deliver(arg.request_id, RequestError(str(exc)))
            elif kind == "abort":
                self.worker.abort(arg)
            else:
                self._run_engine_op(kind, *arg)

    def _run_engine_op(self, kind: str, arg: Any, reply: futures.Future[Any]) -> None:
        try:
            if kind == "clear":
                result: Any = self.worker.clear_cache()
                self._publish(self.worker.full_state_batch())
            elif kind == "check":
                self.worker.check_invariants()
                result = True
            elif kind == "hashes":
                result = [int(h) for h in self.worker.pool.cached_hashes()]
            elif kind == "export":
                result = self.worker.export_blocks(arg)
            elif kind == "pin":
                result = self.worker.pin_run(arg)
            elif kind == "unpin":
                self.worker.unpin(arg)
                result = None
            elif kind == "import_ipc":
                peer_id, handle, ids, hashes, parent = arg
                if peer_id not in self._peer_caches:
                    rebuild, rebuild_args = handle
                    self._peer_caches[peer_id] = rebuild(*rebuild_args)
                cache = self._peer_caches[peer_id]
                result = self.worker.import_from_peer_cache(cache, ids, hashes, parent)
                self._publish_events()
            elif kind == "nccl_send":
                result = self._nccl_send(*arg)
            elif kind == "nccl_recv":
                result = self._nccl_recv(*arg)
                self._publish_events()
            elif kind == "import":
                export, parent = arg
                result = self.worker.import_blocks(export, parent)
                self._publish_events()  # announce imported blocks like computed ones
            else:
                raise ValueError(f"unknown engine op {kind!r}")
        except Exception as exc:  # the caller gets the error; the engine keeps serving
            reply.set_exception(exc)
        else:
            reply.set_result(result)

    def _nccl_send(self, ids: list[int], dst_rank: int) -> int:
        import torch.distributed as dist

        try:
            cache = self.worker.runner.kv_cache
            # Stage the blocks in cache layout with the copy kernel (a gather by advanced
            # indexing runs at a fraction of memory bandwidth), then send one tensor.
            staging = cache.new_empty((*cache.shape[:2], len(ids), *cache.shape[3:]))
            copy_blocks(staging, list(range(len(ids))), cache, ids)
            dist.send(staging, dst=dst_rank)
            torch.cuda.synchronize()
        finally:
            self.worker.unpin(ids)  # type: ignore[arg-type]
        return len(ids)

    def _nccl_recv(
        self, num_blocks: int, src_rank: int, hashes: list[int], parent: int, source: str
    ) -> int:
        import torch.distributed as dist

        cache = self.worker.runner.kv_cache
        staging = cache.new_empty((*cache.shape[:2], num_blocks, *cache.shape[3:]))
        dist.recv(staging, src=src_rank)
        torch.cuda.synchronize()
        return self.worker.import_from_peer_cache(
            staging,
            list(range(num_blocks)),
            hashes,
            parent,  # type: ignore[arg-type]
        )

    def _publish_events(self) -> None:
        if self._publisher is None:
            self.worker.pool.drain_events()
            return
        if self._publisher.lost_events:
            if not self._publisher.heartbeat(self._heartbeat_info(), self._ttl_ms()):
                return  # still unreachable; events keep accumulating in the pool
            self._publisher.lost_events = False
            self._publish(self.worker.full_state_batch())
            return
        batch = self.worker.drain_event_batch()
        if batch is not None:
            self._publish(batch)

    def _publish(self, batch: Any) -> None:
        if self._publisher is not None:
            self._publisher.publish(batch)

    def _heartbeat(self) -> None:
        self._last_heartbeat = time.monotonic()
        if self._publisher is not None:
            self._publisher.heartbeat(self._heartbeat_info(), self._ttl_ms())

    def _heartbeat_info(self) -> dict[str, str | int]:
        i = self.worker.info()
        return {
            "node": i.node,
            "device": i.device,
            "pid": i.pid,
            "model": i.model,
            "block_size": i.block_size,
            "num_blocks": i.num_blocks,
            "num_free_blocks": i.num_free_blocks,
            "updated_ms": time.time_ns() // 1_000_000,
        }

    def _ttl_ms(self) -> int:
        return int(self.config.heartbeat_ttl_s * 1000)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, out = target
            loop.call_soon_threadsafe(out.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = list(self._streams)
        # INTERNAL, not the requests' fault; the message never carries the exception's text.
        failure = SequenceFailure("the worker's engine step failed", internal=True)
        for rid in ids:
            self.worker.abort(rid)
            self._deliver(rid, RequestOutput(rid, (), True, "error", failure=failure))


def remote_worker_class(num_gpus: float, num_cpus: float = 1) -> Any:
    """The actor class with its resources; callers then use `.options(name=...).remote(config)`."""
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=0)(WorkerActor)
