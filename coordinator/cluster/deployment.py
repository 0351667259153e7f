"""Assembles a running kvmesh: Redis (embedded or external), Ray workers, the index follower, the
coordinator and its gRPC server. `kvmesh up`, `kvmesh serve`, the demo and the integration tests
all start the system through this one class, so they run the same code.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import grpc
import ray
import torch

from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.cluster.fleet import Fleet
from kvmesh.coordinator.cluster.redis_server import (
    RedisKeeper,
    RedisServer,
    start_redis_server,
)
from kvmesh.coordinator.cluster.registry import WorkerRegistry
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
from kvmesh.coordinator.routing.links import LinkType
from kvmesh.coordinator.routing.transfer_planner import TransferPlanner
from kvmesh.coordinator.service.admin import Admin
from kvmesh.coordinator.service.chat_template import load_chat_template
from kvmesh.coordinator.service.field_limits import FieldLimits
from kvmesh.coordinator.service.grpc_server import build_server, set_serving
from kvmesh.coordinator.service.http_server import HttpGate, HttpServer, build_app
from kvmesh.coordinator.service.interceptor import GateInterceptor, gate_from_config
from kvmesh.coordinator.service.openai_frontend import OpenAIFrontend
from kvmesh.coordinator.service.servicer import KVMeshServicer
from kvmesh.coordinator.service.tls import load_server_tls
from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.exporter import MetricsExporter
from kvmesh.coordinator.telemetry.request_log import RequestLog
from kvmesh.coordinator.telemetry.request_metrics import RequestMetrics
from kvmesh.proto.block_hash import BlockHash, namespace_hash
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestRejected
from kvmesh.workers.model.model_config import load_model_config
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


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
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.redis: RedisServer | None = None
        self.redis_keeper: RedisKeeper | None = None
        self.cluster: Cluster | None = None
        self.fleet: Fleet | None = None
        self.follower: IndexFollower | None = None
        self.notes: NoteSender | None = None
        self.decisions: DecisionStream | None = None
        self.coordinator: Coordinator | None = None
        self.server: grpc.Server | None = None
        self.gate: GateInterceptor | None = None
        self.metrics: MetricsExporter | None = None
        self.request_metrics = RequestMetrics()
        self.port = 0
        self.http_server: HttpServer | None = None
        self._started_ray = False
        self.engines: EngineFleet | None = None

    def _engine_root(self, lora_name: str, cache_salt: str) -> BlockHash:
        """The coordinator's h_0 for an engine's blocks (its events arrive once it exists)."""
        assert self.coordinator is not None
        return self.coordinator.prompts.root_hash(cache_salt, lora_name)

    def engine_ids(self) -> list[str]:
        """The external engines' ids (empty without engines)."""
        return sorted(self.engines.endpoints()) if self.engines is not None else []

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (e.g. http://127.0.0.1:8000), empty when it is off."""
        return self.http_server.url if self.http_server is not None else ""

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
        cfg = self.config
        cc = cfg.coordinator
        model = load_model_config(cc.model, cc.seed)
        # TLS files first: a bad path should fail before Ray and the workers start.
        tls = (
            load_server_tls(cc.tls_cert_file, cc.tls_key_file, cc.tls_client_ca_file)
            if cc.tls_cert_file
            else None
        )
        if cc.port:  # before anything starts: a taken port is the user's first error to see
            ensure_port_free(cc.host, cc.port)
        if cfg.metrics_port is not None:  # bound first: a port in use fails before Ray starts
            self.metrics = MetricsExporter(cc.host, cfg.metrics_port)
        redis_url = cc.redis_url
        if not redis_url:
            self.redis = start_redis_server()
            self.redis_keeper = RedisKeeper(self.redis)
            redis_url = self.redis.url
        if not ray.is_initialized():
            with without_secrets(os.environ):  # a local start spawns Ray's processes from ours
                # Ray's driver loggers go through our handlers (level, format, JSON) instead of
                # a handler of Ray's own; the workers' output stays in Ray's session logs.
                ray.init(
                    address=cfg.ray_address or "local",
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
            self._started_ray = True
        ns = f"{namespace_hash(model.fingerprint()):016x}"  # shared by every KV dtype and epoch
        registry = WorkerRegistry()
        self.cluster = cluster = Cluster(registry)
        store = IndexStore(redis_url)
        self.fleet = fleet = Fleet(cluster, store, redis_url, own_workers=cfg.own_workers)
        self._start_workers(fleet, redis_url)
        infos = self.cluster.infos()
        first = next(iter(infos.values()), None)
        device = first.device if first is not None else "cpu"
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        kv_bytes_per_token = (
            ModelRunner.kv_bytes_per_block(model, cc.block_size, dtype) // cc.block_size
        )
        transfers = TransferPlanner(
            cluster.latest_info,
            kv_bytes_per_token,
            cc.block_size,
            nccl_members=cluster.nccl_members,
        )
        backend: WorkerBackend = cluster
        if cfg.engines:
            self.engines = EngineFleet(
                cfg.engines,
                cfg.engine_health,
                registry,
                redis_url,
                block_size=cc.block_size,
                model_fingerprint=model.fingerprint(),
                root=self._engine_root,
            )
            backend = EngineBackend(self.engines.endpoints(), cluster, self.engines.mark_down)
        mirror = LockedMirror()
        decisions = DecisionStream(store) if cc.decision_log else None
        self.follower = follower = IndexFollower(
            store, mirror, ns=ns, on_lapsed=registry.report_lapsed
        )
        self.coordinator = coordinator = Coordinator(
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
            kv_dtype=first.cache.kv_dtype if first is not None else "float32",
            cache_epoch=lambda: follower.cache_epoch,
            decision_log=decisions,
        )
        # One judge of liveness, fanned out to everything that keeps per-worker state.
        registry.on_dead(coordinator.forget_worker)
        registry.on_dead(follower.purge_worker)
        registry.on_lapsed(follower.purge_worker)
        if cfg.replace_dead_workers:
            registry.on_dead(fleet.replace_dead)
        if not cfg.attach:
            self._calibrate_links(transfers)
        else:
            self._join_nccl(transfers, may_form=False)
        self.cluster.set_on_info(coordinator.observe_worker)
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
        self.follower.start()
        if self.engines is not None:
            self.engines.start()
        self.cluster.start_monitor(cc.health_interval_s, cc.stall_timeout_s)
        fleet.start_watching(cfg.fleet_poll_s)
        prompt_limit = min(cc.max_prompt_tokens or model.max_position_embeddings,
                           model.max_position_embeddings)  # fmt: skip
        gate = gate_from_config(cc, FieldLimits(max_prompt_tokens=prompt_limit))
        self.gate = gate
        admin = Admin(
            self.cluster,
            self.coordinator,
            mirror,
            fleet,
            bump_cache_epoch=follower.bump_cache_epoch,
            external_pools=self.engines.announced if self.engines is not None else dict,
        )
        servicer = KVMeshServicer(
            self.coordinator,
            self.cluster,
            self.follower,
            admin=admin,
            gate=gate,
            worker_kind=self.engines.kind if self.engines is not None else None,
        )
        self.server, self.port, health = build_server(
            servicer,
            cc.host,
            cc.port,
            max_message_bytes=cc.max_message_bytes,
            max_workers=cc.max_concurrent_rpcs,
            interceptors=[gate],
            tls=tls,
        )
        # Health says SERVING only while some worker can take a request.
        registry.on_changed(lambda: set_serving(health, bool(registry.routable())))
        set_serving(health, bool(registry.routable()))
        self.server.start()
        if cfg.http is not None:
            self._start_http(cfg.http, gate)
        if self.metrics is not None:
            collector = MetricsCollector(
                coordinator,
                registry,
                cluster.latest_info,
                self.request_metrics,
                index=follower,
                num_gate_rejections=lambda: gate.num_rejected,
                engine_streams=self.engines.stream_counts if self.engines is not None else None,
            )
            self.metrics.serve(collector)
        return self.address

    def _start_workers(self, fleet: Fleet, redis_url: str) -> None:
        cfg, cc = self.config, self.config.coordinator
        if cfg.attach:
            fleet.attach()
            return
        if cfg.engines and cfg.num_workers == 0:
            return  # external engines only
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        num_workers = cfg.num_workers or max(num_gpus, 2 if not num_gpus else num_gpus)
        gpus_per_worker = cfg.gpus_per_worker
        if gpus_per_worker < 0:
            gpus_per_worker = 0.0 if not num_gpus else min(1.0, num_gpus / num_workers)
        template = replace(
            cfg.worker,
            model=cc.model,
            block_size=cc.block_size,
            redis_url=redis_url,
            seed=cc.seed,
            gpu_fraction=gpus_per_worker if 0 < gpus_per_worker < 1 else 1.0,
        )
        if cfg.own_workers:
            fleet.start(template, num_workers, gpus_per_worker)
        else:
            fleet.ensure(template, num_workers, gpus_per_worker)

    def _start_http(self, config: HttpConfig, gate: GateInterceptor) -> None:
        """The OpenAI API, sharing the gRPC gate's tokens, rate buckets and stream slots."""
        assert self.coordinator is not None
        cc = self.config.coordinator
        frontend = OpenAIFrontend(
            self.coordinator,
            load_tokenizer(cc.model, cc.seed),
            load_chat_template(cc.model),
            client_errors=(RequestRejected,),
        )
        http_gate = HttpGate(gate.auth, gate.rate, gate.streams)
        app = build_app(frontend, http_gate, config.max_body_bytes, config.max_threads)
        self.http_server = HttpServer(
            app,
            config,
            tls_cert_file=cc.tls_cert_file,
            tls_key_file=cc.tls_key_file,
            tls_client_ca_file=cc.tls_client_ca_file,
        )
        self.http_server.start()

    def _join_nccl(self, transfers: TransferPlanner, *, may_form: bool) -> bool:
        """Plan GPU-to-GPU pulls over the NCCL group the workers already share, else (when
        `may_form`: this coordinator started them) over one formed now; False without one."""
        assert self.cluster is not None
        try:
            if not (self.cluster.adopt_nccl() or (may_form and self.cluster.setup_nccl())):
                return False
        except Exception as exc:  # no NCCL: pulls between GPUs use the object store
            log.warning("NCCL group not available (%s); GPU-to-GPU pulls use the object store", exc)
            return False
        # Start from an NVLink-class guess (50 GB/s, 2 ms); the observed pulls correct it.
        transfers.links.set(LinkType.SAME_NODE, 5e7, 2.0)
        return True

    def _calibrate_links(self, transfers: TransferPlanner) -> None:
        """Measure one worker-to-worker link so the first pulls are priced from reality."""
        assert self.cluster is not None
        live = self.cluster.live_worker_ids()
        if self._join_nccl(transfers, may_form=True):
            return
        if len(live) < 2 or transfers.link(live[0], live[1]) is LinkType.SAME_DEVICE:
            return  # same-GPU pulls copy in place (CUDA IPC): observed pulls price that link
        try:
            bandwidth, latency = self.cluster.measure_link(live[0], live[1])
            transfers.calibrate(live[0], live[1], bandwidth, latency)
            log.info(
                "link %s -> %s: %.0f MB/s, %.2f ms", live[0], live[1], bandwidth / 1e3, latency
            )
        except Exception as exc:  # calibration is an optimisation: keep the defaults
            log.warning("link calibration failed: %s", exc)

    def stop(self) -> None:
        if self.http_server is not None:
            self.http_server.stop()
            self.http_server = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
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
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        if self.redis_keeper is not None:
            self.redis_keeper.stop()
            self.redis_keeper = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


SECRET_ENV_VARS = ("KVMESH_ADMIN_TOKEN", "KVMESH_AUTH_TOKEN", "KVMESH_TOKEN", "KVMESH_REDIS_URL")
"""Variables that may hold a secret: read once by the CLI into the config, never inherited by
Ray's processes (raylet, GCS, every worker). Workers get the Redis URL in their config."""


@contextmanager
def without_secrets(environ: MutableMapping[str, str]) -> Iterator[None]:
    """`environ` without SECRET_ENV_VARS for the duration (the processes started meanwhile
    inherit none of them), then restored."""
    saved = {name: environ.pop(name) for name in SECRET_ENV_VARS if name in environ}
    try:
        yield
    finally:
        environ.update(saved)


def ensure_port_free(host: str, port: int) -> None:
    """Raise OSError naming the port when something already listens on it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # As servers bind: a port whose old connections linger (TIME_WAIT) is free to listen on.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            raise OSError(f"port {port} on {host} is already in use") from None


def _free_blocks(cluster: Cluster, worker_id: str) -> tuple[int, int]:
    info = cluster.latest_info(worker_id)
    if info is None:
        return (1 << 30, 1 << 30)
    return info.num_blocks, info.num_free_blocks
