"""Assembles a running kvmesh: Redis (embedded or external), Ray workers, the index follower, the
coordinator and its gRPC server. `kvmesh up`, `kvmesh serve`, the demo and the integration tests
all start the system through this one class, so they run the same code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import ray
import torch

from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.coordinator.cluster.transfer_manager import TransferManager
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.mirror import IndexMirror
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.coordinator.service.admin import Admin, DrainableBackend
from kvmesh.coordinator.service.chat_template import load_chat_template
from kvmesh.coordinator.service.http_server import HttpGate, HttpServer, build_app
from kvmesh.coordinator.service.interceptor import GateInterceptor, gate_from_config
from kvmesh.coordinator.service.openai_frontend import OpenAIFrontend
from kvmesh.coordinator.service.servicer import KVMeshServicer, build_server
from kvmesh.coordinator.service.tls import load_server_tls
from kvmesh.proto.block_hash import namespace_hash
from kvmesh.workers.actor import RequestError
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.model.model_config import load_model_config
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.model.tokenizer import load_tokenizer
from kvmesh.workers.transfer.links import LinkType

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
    """Ray cluster to join (`auto`); empty starts a local Ray unless one is already running."""
    http: HttpConfig | None = None
    """The OpenAI-compatible HTTP API; None serves gRPC only."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.redis: RedisServer | None = None
        self.cluster: Cluster | None = None
        self.follower: IndexFollower | None = None
        self.coordinator: Coordinator | None = None
        self.server: grpc.Server | None = None
        self.port = 0
        self.http_server: HttpServer | None = None
        self._started_ray = False

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
        redis_url = cc.redis_url
        if not redis_url:
            self.redis = start_redis_server()
            redis_url = self.redis.url
        if not ray.is_initialized():
            ray.init(address=cfg.ray_address or None, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        num_workers = cfg.num_workers or max(num_gpus, 2 if not num_gpus else num_gpus)
        gpus_per_worker = cfg.gpus_per_worker
        if gpus_per_worker < 0:
            gpus_per_worker = 0.0 if not num_gpus else min(1.0, num_gpus / num_workers)
        workers = [
            replace(
                cfg.worker,
                worker_id=f"w{i}",
                model=cc.model,
                block_size=cc.block_size,
                redis_url=redis_url,
                seed=cc.seed,
                gpu_fraction=gpus_per_worker if 0 < gpus_per_worker < 1 else 1.0,
            )
            for i in range(num_workers)
        ]
        ns = f"{namespace_hash(model.fingerprint()):016x}"
        self.cluster = Cluster()
        self.cluster.start_workers(workers, gpus_per_worker)
        infos = self.cluster.infos()
        first: dict[str, Any] = next(iter(infos.values()), {})
        device = str(first.get("device", "cpu"))
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        kv_bytes_per_token = (
            ModelRunner.kv_bytes_per_block(model, cc.block_size, dtype) // cc.block_size
        )
        transfers = TransferManager(
            self.cluster, cluster_info(self.cluster), kv_bytes_per_token, cc.block_size
        )
        mirror, lock = IndexMirror(), threading.Lock()
        store = IndexStore(redis_url)
        self.follower = IndexFollower(store, mirror, lock, ns=ns)
        cluster = self.cluster
        backend = DrainableBackend(cluster)  # admin Drain removes workers from routing here
        self.coordinator = Coordinator(
            cc,
            model,
            backend,
            mirror,
            lock,
            tokenizer=load_tokenizer(cc.model),
            index_connected=lambda: self.follower is not None and self.follower.connected,
            worker_free_blocks=lambda w: _free_blocks(cluster, w),
            transfers=transfers,
        )
        coordinator = self.coordinator
        self._calibrate_links(transfers)

        def on_dead(worker_id: str) -> None:
            coordinator.on_worker_dead(worker_id)
            try:
                store.purge_worker(ns, worker_id)
            except Exception as exc:  # Redis away: the heartbeat sweep purges it later
                log.warning("could not purge %s from Redis: %s", worker_id, exc)

        self.cluster.set_on_worker_dead(on_dead)
        self.cluster.set_on_info(coordinator.observe_worker)
        self.follower.start()
        self.cluster.start_monitor(cc.health_interval_s)
        gate = gate_from_config(cc)
        admin = Admin(self.cluster, self.coordinator, backend)
        servicer = KVMeshServicer(
            self.coordinator, self.cluster, self.follower, admin=admin, gate=gate
        )
        self.server, self.port, _health = build_server(
            servicer,
            cc.host,
            cc.port,
            max_message_bytes=cc.max_message_bytes,
            max_workers=cc.max_concurrent_rpcs,
            interceptors=[gate],
            tls=tls,
        )
        self.server.start()
        if cfg.http is not None:
            self._start_http(cfg.http, gate)
        return self.address

    def _start_http(self, config: HttpConfig, gate: GateInterceptor) -> None:
        """The OpenAI API, sharing the gRPC gate's tokens, rate buckets and stream slots."""
        assert self.coordinator is not None
        cc = self.config.coordinator
        frontend = OpenAIFrontend(
            self.coordinator,
            load_tokenizer(cc.model, cc.seed),
            load_chat_template(cc.model),
            client_errors=(RequestError,),
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

    def _calibrate_links(self, transfers: TransferManager) -> None:
        """Measure one worker-to-worker link so the first pulls are priced from reality."""
        assert self.cluster is not None
        live = self.cluster.live_worker_ids()
        try:
            if self.cluster.setup_nccl():
                # GPU-to-GPU pulls go over NCCL: start from an NVLink-class guess (50 GB/s, 2 ms)
                # and let the observed pulls correct it.
                transfers.links.set(LinkType.SAME_NODE, 5e7, 2.0)
                return
        except Exception as exc:  # no NCCL: pulls between GPUs use the object store
            log.warning("NCCL group not available (%s); GPU-to-GPU pulls use the object store", exc)
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
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def cluster_info(cluster: Cluster) -> Callable[[str], dict[str, Any]]:
    return cluster.latest_info


def _free_blocks(cluster: Cluster, worker_id: str) -> tuple[int, int]:
    info = cluster.latest_info(worker_id)
    if not info:
        return (1 << 30, 1 << 30)
    return int(info["num_blocks"]), int(info["num_free_blocks"])
