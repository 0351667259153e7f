"""Assembles a running kvmesh: Redis (embedded or external), Ray workers, the index follower, the
coordinator and its gRPC server. `kvmesh up`, `kvmesh serve`, the demo and the integration tests
all start the system through this one class, so they run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.cluster.fleet import Fleet
from kvmesh.coordinator.cluster.link_setup import calibrate_links, join_nccl
from kvmesh.coordinator.cluster.ray_runtime import RayRuntime
from kvmesh.coordinator.cluster.redis_server import (
    RedisKeeper,
    RedisServer,
    start_redis_server,
)
from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.cluster.servers import Servers
from kvmesh.coordinator.cluster.worker_plan import plan_workers
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.contract import WorkerBackend
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.engines.engine_backend import EngineBackend
from kvmesh.coordinator.engines.engine_fleet import EngineFleet, EngineFleetConfig, EngineSpec
from kvmesh.coordinator.index.decision_stream import DecisionStream
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.note_sender import NoteSender
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.coordinator.routing.transfer_planner import TransferPlanner
from kvmesh.coordinator.service.admin import Admin
from kvmesh.coordinator.service.servicer import KVMeshServicer
from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.exporter import MetricsExporter
from kvmesh.coordinator.telemetry.request_log import RequestLog
from kvmesh.coordinator.telemetry.request_metrics import RequestMetrics
from kvmesh.proto.block_hash import BlockHash, namespace_hash
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import WorkerInfo
from kvmesh.workers.model.model_config import ModelConfig, load_model_config
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.model.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    """gRPC, routing and index settings."""
    num_workers: int = 2
    """Worker actors to start (0: one per GPU Ray sees, or 2 without GPUs)."""
    worker: WorkerConfig = field(default_factory=lambda: WorkerConfig(worker_id="template"))
    """Template for every worker; worker_id, model, block size and Redis URL are filled in."""
    gpus_per_worker: float = -1.0
    """GPU share per worker; -1: 1 when there are enough GPUs, else an even split of GPU 0's."""
    ray_address: str = ""
    """Ray cluster to join (`auto`, `host:6379`); empty starts a private local Ray (unless this
    process already runs one), never whatever cluster `ray start` last recorded."""
    own_workers: bool = True
    """A local cluster: its workers stop with it. False: workers are long-lived services that
    outlive this coordinator (`kvmesh serve`); missing ones are started, running ones attached."""
    attach: bool = False
    """Start no workers: route over those already registered (another coordinator's fleet)."""
    replace_dead_workers: bool = False
    """Start a replacement (a new id, same config) when a worker dies."""
    fleet_poll_s: float = 2.0
    """How often the directory is read for workers other coordinators started."""
    http: HttpConfig | None = None
    """The OpenAI-compatible HTTP API; None serves gRPC only."""
    metrics_port: int | None = None
    """Prometheus endpoint (`GET /metrics`) on the gRPC host: None serves none, 0 a free port."""
    engines: tuple[EngineSpec, ...] = ()
    """External engines (a vLLM fleet) routed to alongside the workers, fed by their KV events;
    their block size is `coordinator.block_size`. With engines, `num_workers=0` starts no worker."""
    engine_health: EngineFleetConfig = field(default_factory=EngineFleetConfig)
    """How the engines are health-checked (interval, misses before down, heartbeat TTL)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.attach and self.own_workers:
            raise ValueError("attach starts no workers, so it owns none: set own_workers=False")
        if self.fleet_poll_s <= 0:
            raise ValueError(f"fleet_poll_s must be > 0, got {self.fleet_poll_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


class Deployment:
    """One running kvmesh, composed of its parts: Redis (embedded or external) and its keeper,
    the Ray runtime, the worker fleet, the index streams (follower, route notes, decision log),
    the coordinator, external engines, and the servers in front. `start` brings them up in
    order and stops whatever started if a step fails; `stop` takes them down in reverse."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.servers = Servers(config.coordinator, config.http, config.metrics_port)
        self.ray = RayRuntime(config.ray_address)
        self.redis: RedisServer | None = None
        self.redis_keeper: RedisKeeper | None = None
        self.cluster: Cluster | None = None
        self.fleet: Fleet | None = None
        self.follower: IndexFollower | None = None
        self.notes: NoteSender | None = None
        self.decisions: DecisionStream | None = None
        self.coordinator: Coordinator | None = None
        self.request_metrics = RequestMetrics()
        self.engines: EngineFleet | None = None

    def _engine_root(self, lora_name: str, cache_salt: str) -> BlockHash:
        """The coordinator's h_0 for an engine's blocks (its events arrive once it exists)."""
        assert self.coordinator is not None
        return self.coordinator.prompts.root_hash(cache_salt, lora_name)

    def engine_ids(self) -> list[str]:
        """The external engines' ids (empty without engines)."""
        return sorted(self.engines.endpoints()) if self.engines is not None else []

    @property
    def port(self) -> int:
        """The gRPC port (0 before start)."""
        return self.servers.port

    @property
    def metrics(self) -> MetricsExporter | None:
        """The Prometheus endpoint; None when it is off or stopped."""
        return self.servers.metrics

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (e.g. http://127.0.0.1:8000), empty when it is off."""
        http_server = self.servers.http_server
        return http_server.url if http_server is not None else ""

    @property
    def address(self) -> str:
        return f"{self.config.coordinator.host}:{self.port}"

    def start(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        """The start-up sequence: each step uses only what the steps before it started."""
        cc = self.config.coordinator
        model = load_model_config(cc.model, cc.seed)
        self.servers.check()  # TLS files and ports fail before Redis, Ray and the workers start
        redis_url = self._start_redis()
        self.ray.start()
        registry = WorkerRegistry()
        self.cluster = cluster = Cluster(registry, side_door=cc.worker_side_door)
        store = IndexStore(redis_url)
        self.fleet = Fleet(cluster, store, redis_url, own_workers=self.config.own_workers)
        self._start_workers(self.fleet, redis_url)
        first = next(iter(cluster.infos().values()), None)
        transfers = self._plan_transfers(model, cluster, first)
        backend = self._worker_backend(model, registry, redis_url)
        mirror = LockedMirror()
        decisions = DecisionStream(store) if cc.decision_log else None
        self.follower = IndexFollower(
            store, mirror, ns=_index_namespace(model), on_lapsed=registry.report_lapsed
        )
        kv_dtype = first.cache.kv_dtype if first is not None else "float32"
        coordinator = self._build_coordinator(
            model, backend, mirror, registry, transfers, kv_dtype, decisions
        )
        self._fan_out_liveness(registry, coordinator)
        self._price_links(transfers)
        self._start_feeds(store, coordinator, decisions)
        self._start_servers(model, registry, mirror)
        return self.address

    def _start_redis(self) -> str:
        """The configured Redis URL, else an embedded Redis started now (with its keeper)."""
        if self.config.coordinator.redis_url:
            return self.config.coordinator.redis_url
        self.redis = start_redis_server()
        self.redis_keeper = RedisKeeper(self.redis)
        return self.redis.url

    def _start_workers(self, fleet: Fleet, redis_url: str) -> None:
        cfg = self.config
        if cfg.attach:
            fleet.attach()
            return
        if cfg.engines and cfg.num_workers == 0:
            return  # external engines only
        plan = plan_workers(cfg, self.ray.num_gpus(), redis_url)
        if cfg.own_workers:
            fleet.start(plan.template, plan.num_workers, plan.gpus_per_worker)
        else:
            fleet.ensure(plan.template, plan.num_workers, plan.gpus_per_worker)

    def _plan_transfers(
        self, model: ModelConfig, cluster: Cluster, first: WorkerInfo | None
    ) -> TransferPlanner:
        """Pull planning, with the KV bytes a token takes on the first worker's device."""
        cc = self.config.coordinator
        device = first.device if first is not None else "cpu"
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        kv_bytes_per_token = (
            ModelRunner.kv_bytes_per_block(model, cc.block_size, dtype) // cc.block_size
        )
        return TransferPlanner(
            cluster.latest_info,
            kv_bytes_per_token,
            cc.block_size,
            nccl_members=cluster.nccl_members,
        )

    def _worker_backend(
        self, model: ModelConfig, registry: WorkerRegistry, redis_url: str
    ) -> WorkerBackend:
        """The Ray workers, with the external engines (made here, started later) beside them."""
        assert self.cluster is not None
        cfg = self.config
        if not cfg.engines:
            return self.cluster
        self.engines = EngineFleet(
            cfg.engines,
            cfg.engine_health,
            registry,
            redis_url,
            block_size=cfg.coordinator.block_size,
            model_fingerprint=model.fingerprint(),
            root=self._engine_root,
        )
        return EngineBackend(self.engines.endpoints(), self.cluster, self.engines.mark_down)

    def _build_coordinator(
        self,
        model: ModelConfig,
        backend: WorkerBackend,
        mirror: LockedMirror,
        registry: WorkerRegistry,
        transfers: TransferPlanner,
        kv_dtype: str,
        decisions: DecisionStream | None,
    ) -> Coordinator:
        cluster, follower = self.cluster, self.follower
        assert cluster is not None and follower is not None
        cc = self.config.coordinator
        self.coordinator = Coordinator(
            cc,
            model,
            backend,
            mirror,
            registry,
            tokenizer=load_tokenizer(cc.model),
            index_connected=lambda: follower.connected,
            worker_free_blocks=lambda w: _free_blocks(cluster, w),
            transfers=transfers,
            observers=(self.request_metrics, RequestLog()),
            kv_dtype=kv_dtype,
            cache_epoch=lambda: follower.cache_epoch,
            decision_log=decisions,
        )
        return self.coordinator

    def _fan_out_liveness(self, registry: WorkerRegistry, coordinator: Coordinator) -> None:
        """One judge of liveness, fanned out to everything that keeps per-worker state."""
        assert self.follower is not None and self.fleet is not None
        registry.on_dead(coordinator.forget_worker)
        registry.on_dead(self.follower.purge_worker)
        registry.on_lapsed(self.follower.purge_worker)
        if self.config.replace_dead_workers:
            registry.on_dead(self.fleet.replace_dead)

    def _price_links(self, transfers: TransferPlanner) -> None:
        """Workers this deployment started get a measured link; attached ones the NCCL group
        they already share, if any."""
        assert self.cluster is not None
        if not self.config.attach:
            calibrate_links(self.cluster, transfers)
        else:
            join_nccl(self.cluster, transfers, may_form=False)

    def _start_feeds(
        self, store: IndexStore, coordinator: Coordinator, decisions: DecisionStream | None
    ) -> None:
        """What keeps the coordinator current: worker infos, the index follower and its notes,
        this replica's own route notes, the decision log, the engines, the fleet watch."""
        cluster, fleet, follower = self.cluster, self.fleet, self.follower
        assert cluster is not None and fleet is not None and follower is not None
        cc = self.config.coordinator
        cluster.set_on_info(coordinator.observe_worker)
        follower.on_notes = coordinator.observe_notes
        follower.on_notes_skipped = coordinator.forget_peer_routes
        self.notes = notes = NoteSender(store)
        coordinator.note_sink = notes.send
        notes.start()
        if decisions is not None:
            decisions.on_entries = coordinator.decisions.observe
            decisions.on_jump = coordinator.decisions.skip_to
            self.decisions = decisions
            decisions.start()
        follower.start()
        if self.engines is not None:
            self.engines.start()
        cluster.start_monitor(cc.health_interval_s, cc.stall_timeout_s)
        fleet.start_watching(self.config.fleet_poll_s)

    def _start_servers(
        self, model: ModelConfig, registry: WorkerRegistry, mirror: LockedMirror
    ) -> None:
        """gRPC (its servicer and admin), then the HTTP API, then the metrics endpoint."""
        cluster, fleet, follower = self.cluster, self.fleet, self.follower
        coordinator, engines = self.coordinator, self.engines
        assert cluster is not None and fleet is not None and follower is not None
        assert coordinator is not None
        gate = self.servers.open_gate(model.max_position_embeddings)
        admin = Admin(
            cluster,
            coordinator,
            mirror,
            fleet,
            bump_cache_epoch=follower.bump_cache_epoch,
            external_pools=engines.announced if engines is not None else dict,
        )
        servicer = KVMeshServicer(
            coordinator,
            cluster,
            follower,
            admin=admin,
            gate=gate,
            worker_kind=engines.kind if engines is not None else None,
        )
        self.servers.start_grpc(servicer, registry)
        self.servers.start_http(coordinator)
        self.servers.serve_metrics(
            lambda gate: MetricsCollector(
                coordinator,
                registry,
                cluster.latest_info,
                self.request_metrics,
                index=follower,
                num_gate_rejections=lambda: gate.num_rejected,
                engine_streams=engines.stream_counts if engines is not None else None,
            )
        )

    def stop(self) -> None:
        self.servers.stop()
        if self.engines is not None:
            self.engines.stop()
            self.engines = None
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        if self.notes is not None:
            self.notes.stop()
            self.notes = None
        if self.decisions is not None:
            self.decisions.stop()
            self.decisions = None
        if self.fleet is not None:
            self.fleet.stop()  # a service fleet's workers keep running
            self.fleet = None
            self.cluster = None
        self.ray.stop()
        if self.redis_keeper is not None:
            self.redis_keeper.stop()
            self.redis_keeper = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _index_namespace(model: ModelConfig) -> str:
    """The index's key namespace for the model: shared by every KV dtype and cache epoch."""
    return f"{namespace_hash(model.fingerprint()):016x}"


def _free_blocks(cluster: Cluster, worker_id: str) -> tuple[int, int]:
    info = cluster.latest_info(worker_id)
    if info is None:
        return (1 << 30, 1 << 30)
    return info.num_blocks, info.num_free_blocks
