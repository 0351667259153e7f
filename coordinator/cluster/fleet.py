"""Keeps the right workers running: starts them as long-lived services, attaches to the ones
other coordinators started, replaces the dead, grows and shrinks the fleet.

Workers are detached, named Ray actors (`kvmesh-<fleet id>-<worker id>` in the `kvmesh` Ray
namespace), so they outlive the coordinator that started them. Each is registered in Redis'
service directory under a fleet-unique id (`w0`, `w1`, ... from one counter in Redis, never
given twice, and claimed atomically), so coordinators sharing a Redis never share an id, and a
replacement is a new worker to every coordinator. Any coordinator finds every worker there.

    start:   claim id in Redis -> create detached actor -> ping -> registry.add -> share peers
    attach:  read the directory -> ray.get_actor(name) -> ping -> registry.add -> share peers
    replace: the registry says dead -> one coordinator claims the replacement -> start a new id
             from the dead one's config -> drop the dead one's record
    shrink:  drain (no new requests) -> wait for its streams -> kill -> drop its record

A local cluster (`kvmesh up`) owns its workers: they stop with it. A service fleet
(`kvmesh serve`) does not: stopping a coordinator leaves its workers running.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, replace
from typing import Any

import ray

from kvmesh.coordinator.cluster.cluster import Cluster, kill_actor
from kvmesh.coordinator.index.store import IndexStore, WorkerService
from kvmesh.workers.actor import remote_worker_class
from kvmesh.workers.config import WorkerConfig

log = logging.getLogger(__name__)

RAY_NAMESPACE = "kvmesh"
_WORKER_CPUS = 1.0


class PlacementError(RuntimeError):
    """The Ray cluster cannot place the workers asked for (one line for the operator)."""


class Fleet:
    """Invariant: every worker of `cluster` this fleet started holds a claimed id in the
    directory until it is removed; `owned` are the ones that stop with this coordinator."""

    def __init__(
        self,
        cluster: Cluster,
        directory: IndexStore,
        redis_url: str,
        *,
        own_workers: bool,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.cluster = cluster
        self.directory = directory
        self.redis_url = redis_url
        self.own_workers = own_workers
        self.ready_timeout_s = ready_timeout_s
        self.fleet_id = directory.fleet_id()
        self.num_replaced = 0
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()  # one attach at a time (watcher, scale, ensure)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._template: tuple[WorkerConfig, float] | None = None
        self._starting: set[str] = set()  # claimed by `start`, not yet handed to the cluster
        self._replacers: list[threading.Thread] = []
        self._missing_since: dict[str, float] = {}
        self.missing_grace_s = 120.0

    # ---- start and attach ---------------------------------------------------------------------

    def start(self, template: WorkerConfig, num_workers: int, num_gpus: float) -> list[str]:
        """Start `num_workers` new workers from `template`; returns their ids."""
        if num_workers <= 0:
            return []
        self._template = (template, num_gpus)
        check_placeable(num_workers, _WORKER_CPUS, num_gpus)
        cls = remote_worker_class(num_gpus=num_gpus, num_cpus=_WORKER_CPUS)
        started: list[tuple[WorkerConfig, Any]] = []
        for _ in range(num_workers):
            config = replace(template, worker_id=self._claim_id(template, num_gpus))
            actor = cls.options(
                name=self.actor_name(config.worker_id),
                namespace=RAY_NAMESPACE,
                lifetime="detached",
                scheduling_strategy="SPREAD",  # across nodes first (GPUs spread by themselves)
            ).remote(config)
            started.append((config, actor))
        try:
            self._await_ready(started, num_gpus)
            for config, actor in started:
                self.cluster.add_worker(config, actor)
        finally:
            with self._lock:
                self._starting -= {c.worker_id for c, _ in started}
        self.cluster.share_peers()
        return [c.worker_id for c, _ in started]

    def attach(self) -> list[str]:
        """Take every registered worker this coordinator does not know yet into routing;
        returns their ids. A record whose actor no longer exists is dropped."""
        with self._attach_lock:
            return self._attach()

    def _attach(self) -> list[str]:
        attached: list[str] = []
        for service in self.directory.services():
            with self._lock:
                mine = service.worker_id in self._starting  # `start` hands it over itself
            if mine or self.cluster.registry.is_known(service.worker_id):
                continue
            try:
                actor = ray.get_actor(service.actor_name, namespace=service.ray_namespace)
                ray.get(actor.ping.remote(), timeout=10)
            except ValueError:  # no such actor (yet: another coordinator may be starting it)
                self._note_missing(service.worker_id)
                continue
            except Exception as exc:  # starting, or busy: try again at the next look
                log.info("worker %s not reachable yet: %s", service.worker_id, exc)
                continue
            config = self._config_of(service)
            self.cluster.add_worker(config, actor)
            attached.append(service.worker_id)
        if attached:
            self.cluster.share_peers()
        return attached

    def _note_missing(self, worker_id: str) -> None:
        """Drop a record whose actor stayed missing for `missing_grace_s`: it died with nobody
        left to replace it (a record being started elsewhere gets its actor within seconds)."""
        now = time.monotonic()
        since = self._missing_since.setdefault(worker_id, now)
        if now - since >= self.missing_grace_s:
            log.warning("worker %s is registered but gone; dropping it", worker_id)
            self.directory.remove_service(worker_id)
            del self._missing_since[worker_id]

    def ensure(self, template: WorkerConfig, num_workers: int, num_gpus: float) -> list[str]:
        """Attach to what runs, then start what is missing for `num_workers` alive."""
        self._template = (template, num_gpus)
        self.attach()
        missing = num_workers - len(self.cluster.registry.alive())
        return self.start(template, missing, num_gpus) if missing > 0 else []

    def scale_to(self, num_workers: int, drain_timeout_s: float) -> tuple[list[str], list[str]]:
        """Grow or shrink the fleet to `num_workers` alive; returns (started, stopped) ids."""
        if num_workers < 1:
            raise ValueError(f"a fleet needs at least 1 worker, asked for {num_workers}")
        self.attach()
        alive = self.cluster.registry.alive()
        if num_workers > len(alive):
            template, num_gpus = self._growth_template(alive)
            return self.start(template, num_workers - len(alive), num_gpus), []
        return [], self.shrink_to(num_workers, drain_timeout_s)

    def _growth_template(self, alive: list[str]) -> tuple[WorkerConfig, float]:
        if self._template is not None:
            return self._template
        if not alive:
            raise ValueError("no worker to copy the configuration of; start one with kvmesh serve")
        return self.cluster.config(alive[0]), _gpus_of(self.directory, alive[0])

    # ---- replace, shrink, stop ------------------------------------------------------------------

    def replace_dead(self, worker_id: str) -> None:
        """The registry's on_dead: one coordinator starts a replacement, in the background
        (the caller may be a request thread that just saw the worker die)."""
        if self._stop.is_set():
            return  # shutting down: nothing to replace
        thread = threading.Thread(
            target=self._replace, args=(worker_id,), name=f"kvmesh-replace-{worker_id}", daemon=True
        )
        with self._lock:
            self._replacers.append(thread)
        thread.start()

    def _replace(self, worker_id: str) -> None:
        try:
            config = self.cluster.config(worker_id)
        except KeyError:
            return
        self.cluster.forget_actor(worker_id)
        if not any(s.worker_id == worker_id for s in self.directory.services()):
            return  # taken out on purpose (scaled down): nothing to replace
        if not self.directory.claim_replacement(worker_id, ttl_s=self.ready_timeout_s):
            return  # another coordinator does it; its new worker is attached at the next look
        num_gpus = _gpus_of(self.directory, worker_id)
        self.directory.remove_service(worker_id)  # first: the dead id is gone before its heir
        try:
            new = self.start(config, 1, num_gpus)
            self.num_replaced += 1
            log.warning("worker %s died; replaced by %s", worker_id, ", ".join(new))
        except Exception as exc:
            log.error("could not replace worker %s: %s", worker_id, exc)

    def shrink_to(self, num_workers: int, drain_timeout_s: float = 600.0) -> list[str]:
        """Drain and stop the newest workers beyond `num_workers`; returns their ids. Running
        streams finish first (bounded by `drain_timeout_s`)."""
        registry = self.cluster.registry
        alive = sorted(registry.alive(), key=_id_order)
        victims = alive[num_workers:] if num_workers < len(alive) else []
        for w in victims:
            registry.set_drained(w, True)
        deadline = time.monotonic() + drain_timeout_s
        for w in victims:
            while time.monotonic() < deadline and self._busy(w):
                time.sleep(0.1)
            self.directory.remove_service(w)  # first: nobody replaces a worker removed on purpose
            registry.mark_dead(w, "scaled down")
            actor = self.cluster.forget_actor(w)
            if actor is not None:
                kill_actor(actor)
        if victims:
            self.cluster.share_peers()
        return victims

    def start_watching(self, interval_s: float) -> None:
        """Attach, every `interval_s`, to workers other coordinators start."""

        def watch() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.attach()
                except Exception as exc:  # Redis or Ray away for a moment: look again later
                    log.warning("could not read the worker directory: %s", exc)

        self._watcher = threading.Thread(target=watch, name="kvmesh-fleet", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """A local cluster's workers stop with it; a service fleet's keep running."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            replacers = list(self._replacers)
        for thread in replacers:  # a replacement being started is stopped with the rest
            thread.join(timeout=30)
        self.cluster.stop(kill_workers=self.own_workers)
        if self.own_workers:
            for w in self.cluster.worker_ids():
                self.directory.remove_service(w)

    # ---- helpers --------------------------------------------------------------------------------

    def actor_name(self, worker_id: str) -> str:
        return f"kvmesh-{self.fleet_id}-{worker_id}"

    def _claim_id(self, template: WorkerConfig, num_gpus: float) -> str:
        fields = asdict(template)
        fields.pop("redis_url")  # a secret: every coordinator has its own
        with self._lock:
            for _ in range(1 << 16):
                worker_id = f"w{self.directory.next_worker_number()}"
                record = WorkerService(
                    worker_id,
                    self.actor_name(worker_id),
                    RAY_NAMESPACE,
                    num_gpus,
                    json.dumps({**fields, "worker_id": worker_id}),
                )
                if self.directory.claim_service(record):
                    self._starting.add(worker_id)  # under the lock `attach` reads it with
                    return worker_id
        raise RuntimeError("no free worker id left in this fleet")

    def _config_of(self, service: WorkerService) -> WorkerConfig:
        fields = json.loads(service.config_json)
        return WorkerConfig(**{**fields, "redis_url": self.redis_url})

    def _await_ready(self, started: list[tuple[WorkerConfig, Any]], num_gpus: float) -> None:
        pings = [actor.ping.remote() for _, actor in started]
        ready, pending = ray.wait(pings, num_returns=len(pings), timeout=self.ready_timeout_s)
        try:
            ray.get(ready)  # a worker that failed to start raises its error here
        except Exception:
            self._abandon(started)
            raise
        if pending:
            self._abandon(started)
            raise PlacementError(
                f"{len(pending)} of {len(started)} workers ({_WORKER_CPUS:g} CPU,"
                f" {num_gpus:g} GPU each) did not start within {self.ready_timeout_s:g} s;"
                f" the Ray cluster has {_resources(ray.cluster_resources())}"
            )

    def _abandon(self, started: list[tuple[WorkerConfig, Any]]) -> None:
        for config, actor in started:
            ray.kill(actor, no_restart=True)
            self.directory.remove_service(config.worker_id)

    def _busy(self, worker_id: str) -> bool:
        info = self.cluster.fresh_info(worker_id)
        return info is not None and (info.num_running + info.num_waiting) > 0


def check_placeable(num_workers: int, cpus_each: float, gpus_each: float) -> None:
    """Refuse at once what the cluster's free resources cannot hold, naming both sides."""
    free = ray.available_resources()
    need_cpus, need_gpus = num_workers * cpus_each, num_workers * gpus_each
    if need_cpus <= free.get("CPU", 0.0) + 1e-9 and need_gpus <= free.get("GPU", 0.0) + 1e-9:
        return
    raise PlacementError(
        f"cannot place {num_workers} workers ({cpus_each:g} CPU, {gpus_each:g} GPU each:"
        f" {need_cpus:g} CPU, {need_gpus:g} GPU in all); the Ray cluster has"
        f" {_resources(ray.cluster_resources())}, of which {_resources(free)} free"
    )


def _resources(r: dict[str, float]) -> str:
    return f"{r.get('CPU', 0.0):g} CPU, {r.get('GPU', 0.0):g} GPU"


def _gpus_of(directory: IndexStore, worker_id: str) -> float:
    for s in directory.services():
        if s.worker_id == worker_id:
            return s.num_gpus
    return 0.0


def _id_order(worker_id: str) -> tuple[int, str]:
    digits = worker_id.lstrip("w")
    return (int(digits), worker_id) if digits.isdigit() else (1 << 30, worker_id)
