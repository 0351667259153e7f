"""The server subcommands of the `kvmesh` parser, `up` and `serve`, and the flags they share:
listen address, model, workers, security and limits, metrics and logs."""

from __future__ import annotations

import argparse

from kvmesh.client import extension
from kvmesh.client.environment import LOG_LEVELS, CliEnvironment
from kvmesh.client.flag_types import (
    lora_adapter,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from kvmesh.client.help_format import subparser


def _add_listen_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="coordinator gRPC listen address")
    parser.add_argument(
        "--port", type=port_number, default=50051, metavar="P", help="gRPC port (0: a free one)"
    )
    parser.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        metavar="P",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,"
        " /v1/models, /health) on this port (0: a free one; default: gRPC only)",
    )
    parser.add_argument(
        "--http-host", default=None, metavar="HOST", help="HTTP listen address (default: --host)"
    )


def _add_model_options(parser: argparse.ArgumentParser, env: CliEnvironment) -> None:
    parser.add_argument(
        "--model",
        default=env.model,
        metavar="NAME|PATH",
        help="model preset (tiny-random, <preset>-random) or Hugging Face checkpoint folder",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of random-weight model presets"
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block"
    )
    parser.add_argument(
        "--policy",
        default=env.policy,
        help="routing policy: kvmesh, round_robin, least_loaded, session_sticky, ...",
    )
    parser.add_argument(
        "--decision-log",
        action="store_true",
        help="coordinator replicas share one ordered log of routing decisions in Redis"
        " (one round trip per decision; use with several coordinators over one fleet)",
    )
    parser.add_argument(
        "--worker-side-door",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reach workers on the coordinator's node over a Unix socket instead of Ray actor"
        " calls (submits, aborts, output streams) (default: on)",
    )
    parser.add_argument(
        "--speculative-dispatch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --decision-log: send each request to its worker while its decision is being"
        " committed; a lost commit that moves it aborts it there and sends it on (a redirect)"
        " (default: on)",
    )


def _add_worker_options(
    parser: argparse.ArgumentParser, env: CliEnvironment, default_workers: int | None
) -> None:
    """The flags of the workers a server starts, and of the engines it routes to."""
    _add_fleet_options(parser, default_workers)
    _add_worker_memory_options(parser)
    _add_cache_policy_options(parser)
    _add_placement_options(parser, env)


def _add_fleet_options(parser: argparse.ArgumentParser, default_workers: int | None) -> None:
    """Worker actors and external engines; `default_workers` None lets the launcher size the
    fleet (one worker per GPU)."""
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=default_workers,
        metavar="N",
        help="worker actors to start"
        + ("" if default_workers else " (default: one per GPU)")
        + "; 0 with --engine routes external engines only",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ID,BASE_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT[,KIND]]",
        help="an external engine (vLLM, or SGLang with KIND sglang) to route to, fed by its KV"
        " events; repeatable",
    )
    parser.add_argument(
        "--engine-block-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="the engines' KV block size, also used as --block-size (default 16; vLLM's CPU"
        " backend uses 128)",
    )


def _add_worker_memory_options(parser: argparse.ArgumentParser) -> None:
    """What each worker holds: KV blocks, the host tier, LoRA adapters, CUDA graphs."""
    parser.add_argument(
        "--num-blocks",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="KV blocks per worker (0: size from free device memory)",
    )
    parser.add_argument(
        "--host-cache-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="pinned host-memory tier per worker for blocks evicted from the device (0: off)",
    )
    parser.add_argument(
        "--lora",
        type=lora_adapter,
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in folder PATH as NAME on every worker (repeatable);"
        " requests pick it with `adapter`",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on GPU workers, launch every decode step's and every long cached prefill's kernels"
        " one by one instead of replaying a captured CUDA graph",
    )
    parser.add_argument(
        "--no-pipelined-decode",
        action="store_true",
        help="on GPU workers, read every decode step's tokens before launching the next"
        " (by default the next step is queued on the GPU first, fed the tokens there, greedy or"
        " drawn)",
    )


def _add_cache_policy_options(parser: argparse.ArgumentParser) -> None:
    """Prefix caching and warm sessions."""
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn prefix caching off: every request computes its whole prompt, no block is"
        " registered or indexed",
    )
    parser.add_argument(
        "--session-ttl-s",
        type=positive_float,
        default=None,
        metavar="S",
        help="keep an idle session's chain warm this long after its turn (default: 300)",
    )
    parser.add_argument(
        "--session-budget",
        type=float,
        default=None,
        metavar="F",
        help="share of each worker's KV pool idle sessions may keep warm (0: off; default 0.5)",
    )
    parser.add_argument(
        "--session-affinity-blocks",
        type=float,
        default=None,
        metavar="N",
        help="a session's pull to its last worker, in blocks of prefill (default: 1)",
    )


def _add_placement_options(parser: argparse.ArgumentParser, env: CliEnvironment) -> None:
    """Where workers run."""
    parser.add_argument("--device", default=env.device, help="worker device: auto, cpu or cuda")
    parser.add_argument(
        "--gpus-per-worker",
        type=positive_float,
        default=None,
        metavar="F",
        help="GPUs each worker actor reserves (fractions share a GPU; default: 1 on GPU, 0 on CPU)",
    )


def add_up(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "up", "start a local cluster: Redis, Ray, workers and a coordinator")
    _add_listen_options(parser)
    _add_model_options(parser, env)
    _add_worker_options(parser, env, default_workers=2)
    parser.add_argument(
        "--redis-url",
        default=env.redis_url,
        metavar="URL",
        help="use this Redis instead of starting an embedded one",
    )
    parser.add_argument(
        "--ray-address",
        default="",
        metavar="ADDR",
        help="join this Ray cluster instead of starting a private local one",
    )
    _add_security_options(parser, env)
    _add_observability_options(parser, env)
    parser.set_defaults(handler=extension.run_up)


def add_serve(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "serve", "run a coordinator on an existing Ray cluster and Redis")
    parser.add_argument(
        "--redis-url",
        default=env.redis_url,
        required=env.redis_url is None,
        metavar="URL",
        help="the index's Redis, e.g. redis://host:6379/0 (env KVMESH_REDIS_URL)",
    )
    parser.add_argument(
        "--ray-address",
        default=env.ray_address or "auto",
        help="Ray cluster to join (env KVMESH_RAY_ADDRESS)",
    )
    parser.add_argument(
        "--attach",
        action="store_true",
        help="start no workers: route over the workers already registered in Redis",
    )
    _add_listen_options(parser)
    _add_model_options(parser, env)
    _add_worker_options(parser, env, default_workers=None)
    _add_security_options(parser, env)
    _add_observability_options(parser, env)
    parser.set_defaults(handler=extension.run_serve)


def _add_observability_options(parser: argparse.ArgumentParser, env: CliEnvironment) -> None:
    """Metrics endpoint and logs of `up` / `serve` (docs/operations.md)."""
    group = parser.add_argument_group("metrics and logs")
    group.add_argument(
        "--metrics-port",
        type=port_number,
        default=env.metrics_port,
        metavar="P",
        help="serve Prometheus metrics at http://HOST:P/metrics, HOST being --host"
        " (env KVMESH_METRICS_PORT; 0: off)",
    )
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=env.log_level,
        help="log level; info writes one line per request (id, worker, cached / pulled /"
        " computed tokens, TTFT) (env KVMESH_LOG_LEVEL)",
    )
    group.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=env.log_json,
        help="write logs as JSON lines (env KVMESH_LOG_JSON)",
    )


def _add_security_options(parser: argparse.ArgumentParser, env: CliEnvironment) -> None:
    """Server-side auth, TLS and limits (docs/security.md). Token values never show in --help:
    a help text that says "default" keeps the formatter from printing the value."""
    group = parser.add_argument_group("security and limits")
    _add_auth_options(group, env)
    _add_tls_options(group)
    _add_limit_options(group)


def _add_auth_options(group: argparse._ArgumentGroup, env: CliEnvironment) -> None:
    """Bearer tokens: every call's, and the admin calls'."""
    group.add_argument(
        "--auth-token",
        default=env.auth_token,
        metavar="TOKEN",
        help="bearer token every call must carry; flags show in `ps`, so prefer"
        " --auth-token-file or KVMESH_AUTH_TOKEN (default: no authentication)",
    )
    group.add_argument("--auth-token-file", metavar="PATH", help="accepted tokens, one a line")
    group.add_argument(
        "--admin-token",
        default=env.admin_token,
        metavar="TOKEN",
        help="token for the admin calls Drain, ClearCache, VerifyIndex, IndexTree"
        " (env KVMESH_ADMIN_TOKEN; default: none, and with --auth-token admin calls are refused)",
    )
    group.add_argument("--admin-token-file", metavar="PATH", help="admin tokens, one a line")


def _add_tls_options(group: argparse._ArgumentGroup) -> None:
    """gRPC over TLS, optionally mutual."""
    group.add_argument("--tls-cert", metavar="PEM", help="server certificate chain: gRPC over TLS")
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA"
    )


def _add_limit_options(group: argparse._ArgumentGroup) -> None:
    """What one prompt, one client and one stream may take."""
    group.add_argument(
        "--max-prompt-tokens",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="longest prompt accepted (0: the model's context)",
    )
    group.add_argument(
        "--max-concurrent-streams",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="Generate streams served at once (0: bounded by the server's threads only)",
    )
    group.add_argument(
        "--rate-limit",
        type=non_negative_float,
        default=0.0,
        metavar="RPS",
        help="calls per second per client: its token with auth on, else its IP address (0: off)",
    )
    group.add_argument(
        "--rate-limit-burst",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="calls a client may make at once (0: the rate, at least 1)",
    )
    group.add_argument(
        "--stream-send-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="S",
        help="cancel a stream whose client has not read a response for S seconds (0: never)",
    )
