"""`kvmesh up` and `kvmesh serve`: run a deployment in the foreground until SIGINT / SIGTERM.

Flags win over KVMESH_* environment variables, which win over defaults; the CLI merges both
(kvmesh.client.environment) and hands the namespace here.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import replace
from typing import Any

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.cluster.reaper import start_reaper
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.engines.engine_fleet import EngineSpec
from kvmesh.coordinator.service.auth import read_token_file
from kvmesh.coordinator.telemetry.log_format import LogConfig, configure_logging
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig


def _opt(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def deployment_config(args: argparse.Namespace, *, embedded_redis: bool) -> DeploymentConfig:
    redis_url = _opt(args, "redis_url", "")  # the CLI already merged KVMESH_REDIS_URL
    engines = tuple(EngineSpec.parse(text) for text in _opt(args, "engine", None) or ())
    block_size = int(_opt(args, "block_size", 16))
    if engines:  # one chain for every worker: the engines' block size is the coordinator's
        block_size = int(_opt(args, "engine_block_size", None) or 16)
    num_workers = int(_opt(args, "workers", 0 if not embedded_redis else 2))
    if num_workers == 0 and _opt(args, "workers", None) == 0 and not engines:
        raise ValueError("--workers 0 starts no worker: give at least one --engine")
    coordinator = CoordinatorConfig(
        model=_opt(args, "model", "tiny-random"),
        seed=int(_opt(args, "seed", 0)),
        block_size=block_size,
        policy=_opt(args, "policy", "kvmesh"),
        redis_url=redis_url,
        host=_opt(args, "host", "127.0.0.1"),
        port=int(_opt(args, "port", 50051)),
        auth_tokens=_tokens(args, "auth_token"),
        admin_tokens=_tokens(args, "admin_token"),
        tls_cert_file=_opt(args, "tls_cert", ""),
        tls_key_file=_opt(args, "tls_key", ""),
        tls_client_ca_file=_opt(args, "tls_client_ca", ""),
        max_prompt_tokens=int(_opt(args, "max_prompt_tokens", 0)),
        max_concurrent_streams=int(_opt(args, "max_concurrent_streams", 0)),
        rate_limit_rps=float(_opt(args, "rate_limit", 0.0)),
        rate_limit_burst=int(_opt(args, "rate_limit_burst", 0)),
        stream_send_timeout_s=float(_opt(args, "stream_send_timeout", 30.0)),
        session_affinity_blocks=float(_opt(args, "session_affinity_blocks", 1.0)),
        decision_log=bool(_opt(args, "decision_log", False)),
        speculative_dispatch=bool(_opt(args, "speculative_dispatch", True)),
        worker_side_door=bool(_opt(args, "worker_side_door", True)),
    )
    sessions = WarmSessionConfig(
        idle_ttl_s=float(_opt(args, "session_ttl_s", 300.0)),
        budget_fraction=float(_opt(args, "session_budget", 0.5)),
    )
    worker = WorkerConfig(
        worker_id="template",
        num_blocks=int(_opt(args, "num_blocks", 0)),
        host_cache_gb=float(_opt(args, "host_cache_gb", 0.0)),
        device=_opt(args, "device", "auto"),
        sessions=sessions,
        lora_adapters=tuple(_opt(args, "lora", ())),
        prefix_cache=not _opt(args, "no_prefix_cache", False),
        cuda_graphs=not _opt(args, "no_cuda_graphs", False),
        pipelined_decode=not _opt(args, "no_pipelined_decode", False),
    )
    http_port = _opt(args, "http_port", None)
    http = None
    if http_port is not None:
        http = HttpConfig(host=_opt(args, "http_host", coordinator.host), port=int(http_port))
    return DeploymentConfig(
        http=http,
        coordinator=coordinator,
        num_workers=num_workers,
        engines=engines,
        worker=worker,
        gpus_per_worker=float(_opt(args, "gpus_per_worker", -1.0)),
        ray_address=_opt(args, "ray_address", ""),
        metrics_port=int(_opt(args, "metrics_port", 0)) or None,  # the flag's 0 means off
    )


def _tokens(args: argparse.Namespace, name: str) -> tuple[str, ...]:
    """The `--NAME` token plus those of `--NAME-file` (one a line)."""
    tokens = (_opt(args, name, ""),)
    path = _opt(args, f"{name}_file", "")
    return tuple(t for t in tokens if t) + (read_token_file(path) if path else ())


def run_deployment(config: DeploymentConfig, logs: LogConfig | None = None) -> int:
    logs = logs or LogConfig()
    configure_logging(logs)
    stop = threading.Event()
    deployment = Deployment(config)
    try:
        _note("starting Redis, Ray and workers ...", logs.json_lines)
        try:
            address = deployment.start()
        except Exception as exc:  # one line for the user; the details are in the Ray logs
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"kvmesh: error: could not start the cluster: {first_line}", file=sys.stderr)
            return 1
        # After start: ray.init installs its own SIGTERM handler, which would skip our cleanup.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        assert deployment.cluster is not None
        workers = ", ".join(deployment.cluster.worker_ids() + deployment.engine_ids())
        cc = config.coordinator
        security = ("TLS" if cc.tls_cert_file else "plaintext") + (
            ", token auth" if cc.auth_tokens or cc.admin_tokens else ""
        )
        metrics = (
            f"; metrics at http://{deployment.metrics.address}/metrics"
            if deployment.metrics is not None
            else ""
        )
        print(
            f"kvmesh is up at {address} (workers: {workers}; policy {cc.policy}; {security}"
            f"{metrics})",
            flush=True,
        )
        if deployment.http_url:
            print(f"kvmesh OpenAI API at {deployment.http_url}/v1", flush=True)
        stop.wait()
        _note("shutting down ...", logs.json_lines)
        return 0
    finally:
        deployment.stop()


def _note(message: str, log_json: bool) -> None:
    """A progress note on stderr: a log record with JSON logs (every line stays parseable),
    else plain text."""
    if log_json:
        logging.getLogger("kvmesh").info(message)
    else:
        print(f"kvmesh: {message}", file=sys.stderr, flush=True)


def run_up(args: argparse.Namespace) -> int:
    """Local cluster: embedded Redis (unless --redis-url), a private local Ray (unless
    --ray-address), N workers that stop with it, the coordinator. A watch process stops all of
    it if this process dies without cleaning up (SIGKILL, a crash)."""
    config = deployment_config(args, embedded_redis=True)
    reaper = start_reaper()
    try:
        return run_deployment(
            replace(config, own_workers=True, replace_dead_workers=True), log_config(args)
        )
    finally:
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # a clean exit: the watch finds nothing left and ends


def run_serve(args: argparse.Namespace) -> int:
    """A coordinator on an existing Ray cluster and Redis, over long-lived service workers:
    N ensured running (started if missing), or with --attach only those already registered."""
    config = deployment_config(args, embedded_redis=False)
    if not config.coordinator.redis_url:
        raise ValueError("serve needs --redis-url (or KVMESH_REDIS_URL)")
    attach = bool(_opt(args, "attach", False))
    return run_deployment(
        replace(
            config,
            ray_address=config.ray_address or "auto",
            own_workers=False,
            attach=attach,
            replace_dead_workers=True,
        ),
        log_config(args),
    )


def log_config(args: argparse.Namespace) -> LogConfig:
    """The log flags of `up` / `serve` (--log-level, --log-json)."""
    return LogConfig(_opt(args, "log_level", "info"), bool(_opt(args, "log_json", False)))
