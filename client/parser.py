"""The `kvmesh` argument parser: every subcommand, its flags, defaults and help.

Defaults come from `CliEnvironment` (the KVMESH_* variables) so `--help` shows the value a run
would really use. Flag values are range-checked here, where argparse can name the flag; request
semantics (is this token id in the vocabulary?) are the server's to judge.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from importlib import metadata

from kvmesh.client import commands, extension, index_tree, index_verify
from kvmesh.client.environment import LOG_LEVELS, CliEnvironment
from kvmesh.client.extension import Extension, LoadedExtension
from kvmesh.proto.block_hash import MediaItem

Handler = Callable[[argparse.Namespace], int]


def build_parser(
    env: CliEnvironment,
    extensions: Sequence[Extension] = extension.EXTENSIONS,
    loaded: LoadedExtension | None = None,
) -> argparse.ArgumentParser:
    """The full parser. `loaded` is the extension subcommand being run, if any: an extension's
    flags are only known once its module is imported, which happens only when it is chosen."""
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="kvmesh: a distributed KV-cache service for LLM serving.",
        epilog="Run `kvmesh COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_up(sub, env)
    _add_serve(sub, env)
    _add_generate(sub, env)
    _add_route(sub, env)
    _add_lookup(sub, env)
    _add_read_command(sub, env, "stats", "cluster-wide counters", commands.run_stats)
    _add_read_command(sub, env, "workers", "list the worker actors", commands.run_workers)
    _add_index(sub, env)
    _add_scale(sub, env)
    for ext in extensions:
        _add_extension(sub, ext, loaded if loaded is not None and loaded.extension == ext else None)
    return parser


def _version() -> str:
    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


# Flags whose default may come from the environment and hold a secret (a token, a Redis URL with
# its password): --help never prints their value.
_SECRET_DESTS = frozenset({"redis_url", "token", "auth_token", "admin_token"})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where X says something: not for None, "", switches, or help
    text that already explains its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        silent = default is None or default is False or default in ("", argparse.SUPPRESS)
        silent = silent or action.dest in _SECRET_DESTS
        if silent or "default" in text:
            return text
        return super()._get_help_string(action)


def _subparser(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        formatter_class=_HelpFormatter,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _media_item(value: str) -> MediaItem:
    parts = value.split(":")
    try:
        item_hash, offset, length = int(parts[0], 0), int(parts[1]), int(parts[2])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected HASH:OFFSET:LENGTH, got {value!r}") from None
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected HASH:OFFSET:LENGTH, got {value!r}")
    return MediaItem(item_hash, offset, length)


def _lora_adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def _add_listen_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="coordinator gRPC listen address")
    parser.add_argument(
        "--port", type=_port, default=50051, metavar="P", help="gRPC port (0: a free one)"
    )
    parser.add_argument(
        "--http-port",
        type=_port,
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
        "--block-size", type=_positive_int, default=16, metavar="N", help="tokens per KV block"
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


def _add_worker_options(
    parser: argparse.ArgumentParser, env: CliEnvironment, default_workers: int | None
) -> None:
    """`default_workers` None lets the launcher size the fleet (one worker per GPU)."""
    parser.add_argument(
        "--workers",
        type=_non_negative_int,
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
        type=_positive_int,
        default=None,
        metavar="N",
        help="the engines' KV block size, also used as --block-size (default 16; vLLM's CPU"
        " backend uses 128)",
    )
    parser.add_argument(
        "--num-blocks",
        type=_non_negative_int,
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
        type=_lora_adapter,
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in folder PATH as NAME on every worker (repeatable);"
        " requests pick it with `adapter`",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on GPU workers, launch every decode step's kernels one by one instead of replaying"
        " a captured CUDA graph",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn prefix caching off: every request computes its whole prompt, no block is"
        " registered or indexed",
    )
    parser.add_argument(
        "--session-ttl-s",
        type=_positive_float,
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
    parser.add_argument("--device", default=env.device, help="worker device: auto, cpu or cuda")
    parser.add_argument(
        "--gpus-per-worker",
        type=_positive_float,
        default=None,
        metavar="F",
        help="GPUs each worker actor reserves (fractions share a GPU; default: 1 on GPU, 0 on CPU)",
    )


def _add_up(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "up", "start a local cluster: Redis, Ray, workers and a coordinator")
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


def _add_serve(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "serve", "run a coordinator on an existing Ray cluster and Redis")
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


def _add_scale(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(
        sub, "scale", "grow or shrink the fleet of workers (admin; shrinking drains first)"
    )
    _add_client_options(parser, env)
    parser.add_argument(
        "--workers", type=_positive_int, required=True, metavar="N", help="workers alive after"
    )
    parser.add_argument(
        "--drain-timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="longest wait for a leaving worker's running streams",
    )
    parser.set_defaults(handler=commands.run_scale)


def _add_observability_options(parser: argparse.ArgumentParser, env: CliEnvironment) -> None:
    """Metrics endpoint and logs of `up` / `serve` (docs/operations.md)."""
    group = parser.add_argument_group("metrics and logs")
    group.add_argument(
        "--metrics-port",
        type=_port,
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
    group.add_argument("--tls-cert", metavar="PEM", help="server certificate chain: gRPC over TLS")
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA"
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="longest prompt accepted (0: the model's context)",
    )
    group.add_argument(
        "--max-concurrent-streams",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="Generate streams served at once (0: bounded by the server's threads only)",
    )
    group.add_argument(
        "--rate-limit",
        type=_non_negative_float,
        default=0.0,
        metavar="RPS",
        help="calls per second per client: its token with auth on, else its IP address (0: off)",
    )
    group.add_argument(
        "--rate-limit-burst",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="calls a client may make at once (0: the rate, at least 1)",
    )
    group.add_argument(
        "--stream-send-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="cancel a stream whose client has not read a response for S seconds (0: never)",
    )


def _add_client_options(
    parser: argparse.ArgumentParser, env: CliEnvironment, *, many_addresses: bool = False
) -> None:
    parser.add_argument(
        "--address",
        default=[env.address] if many_addresses else env.address,
        nargs="+" if many_addresses else None,
        metavar="HOST:PORT",
        help=(
            "coordinator addresses (env KVMESH_ADDRESS)"
            if many_addresses
            else "coordinator address, or A,B,... replicas to fail over to (env KVMESH_ADDRESS)"
        ),
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=env.timeout_s,
        metavar="SECONDS",
        help="deadline of the call (env KVMESH_TIMEOUT_S; default: none)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--token",
        default=env.token,
        metavar="TOKEN",
        help="bearer token to send (env KVMESH_TOKEN; default: none)",
    )
    parser.add_argument("--tls", action="store_true", help="use TLS, trusting the system's CAs")
    parser.add_argument(
        "--tls-ca",
        default=env.tls_ca,
        metavar="PEM",
        help="use TLS, trusting this CA (env KVMESH_TLS_CA)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")


def _add_prompt_options(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a tokenizer)")
    parser.add_argument("--cache-salt", default="", metavar="S", help="tenant / cache salt")
    parser.add_argument(
        "--adapter", default="", metavar="NAME", help="LoRA adapter (default: the base model)"
    )
    parser.add_argument(
        "--media",
        type=_media_item,
        action="append",
        metavar="HASH:OFFSET:LENGTH",
        help="a media item in the prompt (repeatable; hash in hex with 0x, or decimal)",
    )


def _add_generate(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "generate", "generate tokens and show the request's cache facts")
    _add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=16, metavar="N", help="tokens to generate"
    )
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 is off")
    parser.add_argument("--top-k", type=_non_negative_int, default=0, metavar="K", help="0 is off")
    parser.add_argument(
        "--seed", type=_non_negative_int, default=0, metavar="N", help="sampling seed"
    )
    parser.add_argument("--stop-token-ids", default="", metavar="IDS", help="e.g. 2,32000")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--worker", default="", metavar="ID", help="force this worker")
    parser.add_argument("--session", default="", metavar="ID", help="session id (soft affinity)")
    _add_bypass_option(parser)
    parser.set_defaults(handler=commands.run_generate)


def _add_route(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "route", "show which worker the router would pick, and the costs")
    _add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.add_argument("--session", default="", metavar="ID", help="session id (soft affinity)")
    parser.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="tokens the request would generate (default: unknown); decode is priced over them",
    )
    _add_bypass_option(parser)
    parser.set_defaults(handler=commands.run_route)


def _add_bypass_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bypass-cache",
        action="store_true",
        help="reuse no cached KV and leave none behind (routed by load only)",
    )


def _add_lookup(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "lookup", "show how much of a prompt each worker already caches")
    _add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.set_defaults(handler=commands.run_lookup)


def _add_index(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = _subparser(sub, "index", "check the prefix index against the workers' pools")
    actions = parser.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    summary = (
        "compare Redis, each coordinator's mirror and each worker's pool; exit 1 if they differ"
    )
    verify = actions.add_parser(
        "verify", help=summary, description=summary + ".", formatter_class=_HelpFormatter
    )
    _add_client_options(verify, env, many_addresses=True)
    verify.add_argument(
        "--redis-url",
        default=env.redis_url,
        metavar="URL",
        help="also compare the index in this Redis (env KVMESH_REDIS_URL; default: mirrors"
        " and pools only)",
    )
    verify.add_argument(
        "--wait",
        type=_non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="under traffic the views differ for milliseconds: look again this long before"
        " reporting a difference",
    )
    verify.set_defaults(handler=index_verify.run_index_verify)
    summary = "show a coordinator's prefix tree: depth, tokens, holders per tier, hits"
    tree = actions.add_parser(
        "tree", help=summary, description=summary + ".", formatter_class=_HelpFormatter
    )
    _add_client_options(tree, env)
    tree.add_argument(
        "--max-nodes",
        type=_tree_size,
        default=1000,
        metavar="N",
        help="show at most N blocks, in tree order (1..100000)",
    )
    tree.set_defaults(handler=index_tree.run_index_tree)
    summary = "show the hottest prefixes (most lookups ended there) and who holds them"
    top = actions.add_parser(
        "top", help=summary, description=summary + ".", formatter_class=_HelpFormatter
    )
    _add_client_options(top, env)
    top.add_argument(
        "--limit", type=_tree_size, default=20, metavar="N", help="show N prefixes (1..100000)"
    )
    top.set_defaults(handler=index_tree.run_index_top)


def _tree_size(text: str) -> int:
    value = int(text) if text.strip().isdigit() else -1
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 100000], got {text!r}")
    return value


def _add_read_command(
    sub: argparse._SubParsersAction, env: CliEnvironment, name: str, summary: str, run: Handler
) -> None:
    parser = _subparser(sub, name, summary)
    _add_client_options(parser, env)
    parser.set_defaults(handler=run)


def _add_extension(
    sub: argparse._SubParsersAction, ext: Extension, loaded: LoadedExtension | None
) -> None:
    parser = _subparser(sub, ext.name, ext.help)
    if loaded is None:
        return  # not the chosen command: its module stays unimported
    if loaded.module is None:
        parser.description = f"{parser.description} (not available in this build: {loaded.reason})"
        return
    add_arguments = getattr(loaded.module, "add_arguments", None)
    if callable(add_arguments):
        add_arguments(parser)
    parser.set_defaults(handler=getattr(loaded.module, ext.run_name))
