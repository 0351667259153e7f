"""Worker lifecycle through Ray: start one actor per GPU (or N on CPU), watch them, stream calls.

The coordinator's Ray shell. A worker is declared dead when a call or a health ping says its actor
died; `on_worker_dead` then purges it from the index and the router stops seeing it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from kvmesh.coordinator.coordinator import WorkerDied
from kvmesh.workers.actor import RequestError, remote_worker_class
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.engine.worker import RequestOutput, WorkerRequest

log = logging.getLogger(__name__)


@dataclass
class _Handle:
    config: WorkerConfig
    actor: Any
    alive: bool = True


class Cluster:
    """Invariant: a worker id maps to one actor; once marked dead it is never routed to again."""

    def __init__(self, on_worker_dead: Callable[[str], None] | None = None) -> None:
        self._handles: dict[str, _Handle] = {}
        self._lock = threading.Lock()
        self._on_worker_dead = on_worker_dead
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._latest_info: dict[str, dict[str, Any]] = {}
        self._ipc_handles: dict[str, Any] = {}
        self._on_info: Callable[[str, dict[str, Any]], None] | None = None
        self._nccl_ranks: dict[str, int] = {}
        self._nccl_lock = threading.Lock()

    def set_on_worker_dead(self, callback: Callable[[str], None]) -> None:
        self._on_worker_dead = callback

    def set_on_info(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        """Called from the health loop with every worker's fresh info (pool, counters)."""
        self._on_info = callback

    def start_workers(
        self, configs: list[WorkerConfig], num_gpus: float, *, ready_timeout_s: float = 600.0
    ) -> None:
        cls = remote_worker_class(num_gpus=num_gpus)
        for cfg in configs:
            actor = cls.remote(cfg)
            with self._lock:
                self._handles[cfg.worker_id] = _Handle(cfg, actor)
        pings = [h.actor.ping.remote() for h in self._handles.values()]
        ray.get(pings, timeout=ready_timeout_s)

    def start_monitor(self, interval_s: float) -> None:
        self._monitor = threading.Thread(
            target=self._watch, args=(interval_s,), name="kvmesh-health", daemon=True
        )
        self._monitor.start()

    def worker_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._handles)

    def live_worker_ids(self) -> list[str]:
        with self._lock:
            return sorted(w for w, h in self._handles.items() if h.alive)

    def is_alive(self, worker_id: str) -> bool:
        with self._lock:
            h = self._handles.get(worker_id)
            return h is not None and h.alive

    def actor(self, worker_id: str) -> Any:
        with self._lock:
            return self._handles[worker_id].actor

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        """Stream a request's outputs; raises RequestError (bad input) or WorkerDied. Closing
        the iterator early (a client that left, a stop string) cancels the worker's stream, so it
        stops computing for the request instead of running on to max_tokens."""
        stream = self.actor(worker_id).generate.remote(request)
        finished = False
        try:
            for ref in stream:
                output: RequestOutput = ray.get(ref)
                finished = output.finished
                yield output
        except GeneratorExit:
            if not finished:
                ray.cancel(stream)
            raise
        except RayTaskError as exc:
            cause = exc.cause if hasattr(exc, "cause") else None
            if isinstance(cause, RequestError):
                raise cause from None
            if isinstance(exc, RayActorError):
                self.mark_dead(worker_id)
                raise WorkerDied(worker_id) from None
            raise
        except RayActorError:
            self.mark_dead(worker_id)
            raise WorkerDied(worker_id) from None

    def pull(
        self, target: str, source: str, hashes: list[int], parent: int, timeout_s: float = 60.0
    ) -> int:
        """Have `target` fetch `source`'s run of `hashes`; returns how many of them `target`
        holds afterwards, 0 when the transfer failed (the request then recomputes).

        Workers on one GPU copy straight from each other's cache (CUDA IPC); others go through
        Ray's object store as one contiguous tensor.
        """
        try:
            if self._same_gpu(source, target):
                return self._pull_ipc(target, source, hashes, parent, timeout_s)
            if source in self._nccl_ranks and target in self._nccl_ranks:
                return self._pull_nccl(target, source, hashes, parent, timeout_s)
            export = self.actor(source).export_blocks.remote(hashes)
            importing = self.actor(target).import_blocks.remote(export, parent)
            return int(ray.get(importing, timeout=timeout_s))
        except RayActorError:
            self._mark_dead_among(source, target)
        except (RayError, GetTimeoutError) as exc:
            log.warning("pull %s -> %s failed: %s", source, target, str(exc).splitlines()[0])
        return 0

    def _same_gpu(self, a: str, b: str) -> bool:
        ia, ib = self.latest_info(a), self.latest_info(b)
        device = str(ia.get("device", ""))
        return (
            device.startswith("cuda")
            and device == ib.get("device")
            and ia.get("node") == ib.get("node")
        )

    def setup_nccl(self, timeout_s: float = 120.0) -> bool:
        """Put every live CUDA worker on its own GPU into one NCCL group (GPU-to-GPU pulls)."""
        live = self.live_worker_ids()
        devices = {w: self.latest_info(w).get("device", "") for w in live}
        on_gpus = all(str(d).startswith("cuda") for d in devices.values())
        if len(live) < 2 or not on_gpus or len(set(devices.values())) < len(live):
            return False  # NCCL cannot put two ranks on one GPU: same-GPU pulls use CUDA IPC
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        init = f"tcp://{host}:{port}"
        ray.get(
            [self.actor(w).nccl_init.remote(init, len(live), r) for r, w in enumerate(live)],
            timeout=timeout_s,
        )
        with self._lock:
            self._nccl_ranks = {w: r for r, w in enumerate(live)}
        return True

    def _pull_nccl(
        self, target: str, source: str, hashes: list[int], parent: int, timeout_s: float
    ) -> int:
        # NCCL point-to-point calls must pair up in the same order on both ranks: one at a time.
        with self._nccl_lock:
            peer = self.actor(source)
            ids = ray.get(peer.pin_blocks.remote(hashes), timeout=timeout_s)
            if not ids:
                return 0
            send = peer.nccl_send.remote(ids, self._nccl_ranks[target])
            recv = self.actor(target).nccl_recv.remote(
                len(ids), self._nccl_ranks[source], hashes[: len(ids)], parent, source
            )
            held = int(ray.get(recv, timeout=timeout_s))
            ray.get(send, timeout=timeout_s)
            return held

    def _pull_ipc(
        self, target: str, source: str, hashes: list[int], parent: int, timeout_s: float
    ) -> int:
        peer = self.actor(source)
        with self._lock:
            handle = self._ipc_handles.get(source)
        if handle is None:
            handle = ray.get(peer.ipc_handle.remote(), timeout=timeout_s)
            with self._lock:
                self._ipc_handles[source] = handle
        ids = ray.get(peer.pin_blocks.remote(hashes), timeout=timeout_s)
        try:
            if not ids:
                return 0
            call = self.actor(target).import_from_peer.remote(
                source, handle, ids, hashes[: len(ids)], parent
            )
            return int(ray.get(call, timeout=timeout_s))
        finally:
            peer.unpin_blocks.remote(ids)

    def _mark_dead_among(self, *worker_ids: str) -> None:
        for w in worker_ids:
            try:
                ray.get(self.actor(w).ping.remote(), timeout=2)
            except (RayError, GetTimeoutError):
                self.mark_dead(w)

    def measure_link(
        self, source: str, target: str, num_bytes: int = 32 << 20
    ) -> tuple[float, float]:
        """(bytes per ms, fixed latency in ms) of moving probes source -> target."""

        def move(n: int) -> float:
            started = time.perf_counter()
            probe = self.actor(source).make_probe.remote(n)
            ray.get(self.actor(target).consume_probe.remote(probe), timeout=60)
            return (time.perf_counter() - started) * 1e3

        move(1)  # warm both actors' call paths
        latency_ms = min(move(1) for _ in range(3))
        big_ms = move(num_bytes)
        return num_bytes / max(1e-6, big_ms - latency_ms), latency_ms

    def infos(self, timeout_s: float = 2.0) -> dict[str, dict[str, Any]]:
        with self._lock:
            live = {w: h.actor for w, h in self._handles.items() if h.alive}
        refs = {w: a.info.remote() for w, a in live.items()}
        out: dict[str, dict[str, Any]] = {}
        for w, ref in refs.items():
            try:
                out[w] = ray.get(ref, timeout=timeout_s)
                with self._lock:
                    self._latest_info[w] = out[w]
            except RayActorError:
                self.mark_dead(w)
            except GetTimeoutError:
                log.warning("worker %s did not report its info within %.1f s", w, timeout_s)
        return out

    def call_all(self, method: str, timeout_s: float = 30.0) -> dict[str, Any]:
        with self._lock:
            live = {w: h.actor for w, h in self._handles.items() if h.alive}
        refs = {w: getattr(a, method).remote() for w, a in live.items()}
        return {w: ray.get(r, timeout=timeout_s) for w, r in refs.items()}

    def mark_dead(self, worker_id: str) -> None:
        with self._lock:
            h = self._handles.get(worker_id)
            if h is None or not h.alive:
                return
            h.alive = False
        log.warning("worker %s died; removing it from the index and the router", worker_id)
        if self._on_worker_dead is not None:
            self._on_worker_dead(worker_id)

    def latest_info(self, worker_id: str) -> dict[str, Any]:
        """The worker's last reported info (pool usage, counters); empty before the first."""
        with self._lock:
            return dict(self._latest_info.get(worker_id, {}))

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                live = {w: h.actor for w, h in self._handles.items() if h.alive}
            refs = {w: a.info.remote() for w, a in live.items()}
            for w, ref in refs.items():
                try:
                    info = ray.get(ref, timeout=max(2.0, 4 * interval_s))
                except RayActorError:
                    self.mark_dead(w)
                except GetTimeoutError:
                    pass  # busy, not dead: the heartbeat in Redis is the other judge
                else:
                    with self._lock:
                        self._latest_info[w] = info
                    if self._on_info is not None:
                        self._on_info(w, info)

    def stop(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            try:
                ray.get(h.actor.shutdown.remote(), timeout=5)
            except Exception:  # already dead or stuck: kill below either way
                pass
            ray.kill(h.actor, no_restart=True)
