"""Worker lifecycle through Ray: start one actor per GPU (or N on CPU), watch them, stream calls.

The coordinator's Ray shell. When a call or a health ping says a worker's actor died, the shell
tells the worker registry (`registry.py`), the one judge of liveness, which fans the death out to
the index, the load tracker and the policy.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from kvmesh.coordinator.cluster.output_reader import Delivery, OutputReader
from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.contract import WorkerDied
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestOutput, WorkerInfo
from kvmesh.workers.contract.requests import WorkerRequest

log = logging.getLogger(__name__)

_STREAM_OPEN_TIMEOUT_S = 60.0
"""How long a request waits for its worker to open the output stream (a worker just started)."""


@dataclass(frozen=True, slots=True)
class _Handle:
    config: WorkerConfig
    actor: Any


class Cluster:
    """Invariant: a worker id maps to one actor, and every id is known to the registry."""

    def __init__(self, registry: WorkerRegistry, side_door: bool = True) -> None:
        """`side_door`: reach workers on this node over their request channel, not Ray
        (`CoordinatorConfig.worker_side_door`)."""
        self.registry = registry
        self._side_door = side_door
        self._handles: dict[str, _Handle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._latest_info: dict[str, WorkerInfo] = {}
        self._on_info: Callable[[str, WorkerInfo], None] | None = None
        self._nccl_ranks: dict[str, int] = {}
        self._stall_timeout_s = 15.0
        self._readers: dict[str, OutputReader] = {}  # worker id -> its outputs to us

    def set_on_info(self, callback: Callable[[str, WorkerInfo], None]) -> None:
        """Called from the health loop with every worker's fresh info (pool, counters)."""
        self._on_info = callback

    def add_worker(self, config: WorkerConfig, actor: Any) -> None:
        """Take a worker actor (started or attached by the fleet) into routing."""
        with self._lock:
            if config.worker_id in self._handles:
                raise ValueError(f"worker id {config.worker_id!r} already has an actor")
            self._handles[config.worker_id] = _Handle(config, actor)
        self.registry.add(config.worker_id)
        # Known from its config before its first report, so its adapters route at once.
        self.registry.set_adapters(config.worker_id, (name for name, _ in config.lora_adapters))

    def forget_actor(self, worker_id: str) -> Any:
        """Drop a worker's actor handle (scaled down or replaced); returns it."""
        with self._lock:
            handle = self._handles.pop(worker_id, None)
            self._latest_info.pop(worker_id, None)
            reader = self._readers.pop(worker_id, None)
        if reader is not None:
            reader.close()
        return handle.actor if handle is not None else None

    def config(self, worker_id: str) -> WorkerConfig:
        with self._lock:
            return self._handles[worker_id].config

    def share_peers(self, timeout_s: float = 60.0) -> None:
        """Tell every live worker every other's actor handle (pull sources)."""
        peers = self._live_actors()
        ray.get([a.set_peers.remote(peers) for a in peers.values()], timeout=timeout_s)

    def start_monitor(self, interval_s: float, stall_timeout_s: float = 15.0) -> None:
        self._stall_timeout_s = stall_timeout_s
        self._monitor = threading.Thread(
            target=self._watch, args=(interval_s,), name="kvmesh-health", daemon=True
        )
        self._monitor.start()

    def worker_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._handles)

    def live_worker_ids(self) -> list[str]:
        return self.registry.alive()

    def is_alive(self, worker_id: str) -> bool:
        return self.registry.is_alive(worker_id)

    def _live_actors(self) -> dict[str, Any]:
        alive = set(self.registry.alive())
        with self._lock:
            return {w: h.actor for w, h in self._handles.items() if w in alive}

    def actor(self, worker_id: str) -> Any:
        with self._lock:
            return self._handles[worker_id].actor

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        """Stream a request's outputs; raises RequestRejected, WorkerFailed or WorkerDied.
        The request goes to the worker on the first read (`send` sends it at once). Closing the
        iterator early (a client that left, a stop string) aborts the request on the worker, so
        it stops computing for it instead of running on to max_tokens."""
        call = self._call(worker_id, request)
        try:
            for item in call:
                if item is not None:
                    yield item
        finally:
            call.close()

    def send(self, worker_id: str, request: WorkerRequest) -> Generator[RequestOutput, None, None]:
        """As `generate`, but the request is submitted before this returns (speculative
        dispatch: the coordinator commits its decision while the submit travels). Closing the
        stream, read or not, aborts the request on the worker."""
        call = self._call(worker_id, request)
        first = next(call)  # submits: the call's first item is None
        assert first is None
        return cast(Generator[RequestOutput, None, None], call)

    def _call(
        self, worker_id: str, request: WorkerRequest
    ) -> Generator[RequestOutput | None, None, None]:
        """One request on one worker: yields None once it is submitted (or found unsendable,
        which the next read raises), then its outputs.
        The request goes to the worker with `submit`; its outputs come back on the worker's one
        stream to this coordinator (`output_reader.py`: through the worker's side door when it
        runs on this node, else Ray), and those that queued while the caller was busy with the
        last one come out joined (`RequestOutput.then`). Closed before its final output, it
        aborts the request on the worker."""
        actor = self.actor(worker_id)
        reader = self._reader(worker_id, actor, request.origin)
        rid = request.request_id
        outputs = reader.register(rid)
        sent = finished = False
        try:
            if outputs is None or not reader.wait_open(_STREAM_OPEN_TIMEOUT_S):
                yield None
                raise WorkerDied(worker_id)  # the stream broke (or never opened)
            submitted = reader.submit(request)
            sent = True
            yield None
            reader.wait_accepted(submitted)
            held: Delivery | None = None
            while True:
                item = held if held is not None else outputs.get()
                held = None
                if isinstance(item, str):  # WORKER_DIED: the reader marked it dead
                    raise WorkerDied(worker_id)
                if isinstance(item, Exception):
                    raise item
                # Outputs that queued while the caller was busy with the last go out as one.
                while item.joinable and not outputs.empty():
                    later = outputs.get_nowait()
                    if not isinstance(later, RequestOutput) or later.failure is not None:
                        held = later
                        break
                    item = item.then(later)
                finished = item.finished
                yield item
                if finished:
                    return
        except GeneratorExit:
            if sent and not finished:
                reader.abort(rid)
            raise
        finally:
            reader.unregister(rid)

    def _reader(self, worker_id: str, actor: Any, origin: str) -> OutputReader:
        """This coordinator's reader of `actor`'s outputs (one per actor; a new one after the
        last broke, or when the worker id has a new actor)."""
        with self._lock:
            reader = self._readers.get(worker_id)
            if reader is not None and reader.actor is actor and reader.alive:
                return reader
            reader = OutputReader(
                worker_id,
                actor,
                origin,
                on_died=lambda: self._actor_died(worker_id, actor),
                use_side_door=self._side_door,
            )
            self._readers[worker_id] = reader
            return reader

    def via_side_door(self, worker_id: str) -> bool:
        """Whether this coordinator's stream to the worker goes through its side door."""
        with self._lock:
            reader = self._readers.get(worker_id)
        return reader is not None and reader.alive and reader.via_side_door

    def nccl_members(self) -> frozenset[str]:
        """Workers in the NCCL group (GPU-to-GPU pulls), empty without one."""
        with self._lock:
            return frozenset(self._nccl_ranks)

    def adopt_nccl(self, timeout_s: float = 10.0) -> bool:
        """Take the NCCL group the live workers already share (formed by the coordinator that
        started them), so a replica or a restarted coordinator plans GPU-to-GPU pulls over it
        too. False when no two live workers report the same group."""
        live = self.live_worker_ids()
        groups = ray.get([self.actor(w).nccl_group.remote() for w in live], timeout=timeout_s)
        members = agreed_nccl_group(dict(zip(live, groups, strict=True)))
        if not members:
            return False
        with self._lock:
            self._nccl_ranks = members
        return True

    def setup_nccl(self, timeout_s: float = 120.0) -> bool:
        """Put every live CUDA worker on its own GPU into one NCCL group (GPU-to-GPU pulls)."""
        live = self.live_worker_ids()
        devices = {w: i.device if (i := self.latest_info(w)) else "" for w in live}
        on_gpus = all(d.startswith("cuda") for d in devices.values())
        if len(live) < 2 or not on_gpus or len(set(devices.values())) < len(live):
            return False  # NCCL cannot put two ranks on one GPU: same-GPU pulls use CUDA IPC
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        init = f"tcp://{host}:{port}"
        ranks = {w: r for r, w in enumerate(live)}
        ray.get([self.actor(w).nccl_init.remote(init, ranks) for w in live], timeout=timeout_s)
        ray.get([self.actor(w).nccl_warm_up.remote() for w in live], timeout=timeout_s)
        with self._lock:
            self._nccl_ranks = ranks
        return True

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

    def infos(self, timeout_s: float = 2.0) -> dict[str, WorkerInfo]:
        live = self._live_actors()
        refs = {w: a.info.remote() for w, a in live.items()}
        out: dict[str, WorkerInfo] = {}
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

    def fresh_info(self, worker_id: str, timeout_s: float = 5.0) -> WorkerInfo | None:
        """Ask one worker now (None if it does not answer in time or is gone)."""
        try:
            info: WorkerInfo = ray.get(self.actor(worker_id).info.remote(), timeout=timeout_s)
        except (KeyError, RayActorError, GetTimeoutError):
            return None
        with self._lock:
            self._latest_info[worker_id] = info
        return info

    def call_all(self, method: str, *args: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        live = self._live_actors()
        refs = {w: getattr(a, method).remote(*args) for w, a in live.items()}
        return {w: ray.get(r, timeout=timeout_s) for w, r in refs.items()}

    def mark_dead(self, worker_id: str) -> None:
        self.registry.mark_dead(worker_id, "its actor died")

    def _actor_died(self, worker_id: str, actor: Any) -> None:
        """A reader's stream broke with its actor: dead, unless the id has a new actor since."""
        with self._lock:
            handle = self._handles.get(worker_id)
        if handle is not None and handle.actor is actor:
            self.mark_dead(worker_id)

    def latest_info(self, worker_id: str) -> WorkerInfo | None:
        """The worker's last reported info (pool usage, counters); None before the first."""
        with self._lock:
            return self._latest_info.get(worker_id)

    def _watch(self, interval_s: float) -> None:
        last_answer: dict[str, float] = {}
        while not self._stop.wait(interval_s):
            live = self._live_actors()
            refs = {w: a.info.remote() for w, a in live.items()}
            for w, ref in refs.items():
                now = time.monotonic()
                try:
                    info: WorkerInfo = ray.get(ref, timeout=max(2.0, 4 * interval_s))
                except RayActorError:
                    self.mark_dead(w)
                except GetTimeoutError:
                    # Busy or stopped: the second only once it lasts past the stall timeout.
                    silent_s = now - last_answer.setdefault(w, now)
                    if silent_s > self._stall_timeout_s:
                        self.end_stalled(w, f"no answer for {silent_s:.0f} s")
                except RayError as exc:  # info() itself failed: the watch must go on
                    log.warning("worker %s could not report: %s", w, str(exc).splitlines()[0])
                else:
                    last_answer[w] = time.monotonic()
                    with self._lock:
                        self._latest_info[w] = info
                    if info.engine_stalled_s > self._stall_timeout_s:
                        self.end_stalled(w, f"engine stuck for {info.engine_stalled_s:.0f} s")
                    elif self._on_info is not None:
                        self._on_info(w, info)

    def end_stalled(self, worker_id: str, why: str) -> None:
        """A worker that makes no progress is dead for routing: killed, so its streams fail over
        (migrate) at once, and handed to the registry like any dead worker."""
        log.warning("worker %s stalled (%s); ending it", worker_id, why)
        self.registry.mark_dead(worker_id, f"stalled: {why}")
        try:
            ray.kill(self.actor(worker_id), no_restart=True)
        except (KeyError, ValueError):
            pass

    def stop(self, *, kill_workers: bool = True) -> None:
        """Stop watching; with `kill_workers` also end every worker actor (a local cluster).
        Service workers outlive their coordinator: `kill_workers=False` leaves them running."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        with self._lock:
            readers = list(self._readers.values())
            self._readers.clear()
        for reader in readers:
            reader.close()
        if not kill_workers:
            return
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            kill_actor(h.actor)


def kill_actor(actor: Any) -> None:
    try:
        ray.get(actor.shutdown.remote(), timeout=5)
    except Exception:  # already dead or stuck: kill below either way
        pass
    ray.kill(actor, no_restart=True)


def agreed_nccl_group(reports: dict[str, dict[str, int]]) -> dict[str, int]:
    """The members (worker id -> rank) of the NCCL group that most live workers report being in,
    counting only workers that report that very group; empty unless at least two do. A worker
    that joined later (a replacement) or left is simply not a member."""
    counts: dict[tuple[tuple[str, int], ...], list[str]] = {}
    for worker_id, group in reports.items():
        if group.get(worker_id) is not None:
            counts.setdefault(tuple(sorted(group.items())), []).append(worker_id)
    if not counts:
        return {}
    group_key, members = max(counts.items(), key=lambda kv: (len(kv[1]), kv[0]))
    ranks = dict(group_key)
    return {w: ranks[w] for w in sorted(members)} if len(members) >= 2 else {}
