"""The `kvmesh` subcommands that call a running coordinator: `generate`, `route`, `lookup`, the
read commands (`stats`, `workers`) and `scale`, and the connection and prompt flags they share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvmesh.client import commands
from kvmesh.client.environment import CliEnvironment
from kvmesh.client.flag_types import media_item, non_negative_int, positive_float, positive_int
from kvmesh.client.help_format import subparser

Handler = Callable[[argparse.Namespace], int]


def add_client_options(
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
        type=positive_float,
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
        type=media_item,
        action="append",
        metavar="HASH:OFFSET:LENGTH",
        help="a media item in the prompt (repeatable; hash in hex with 0x, or decimal)",
    )


def add_generate(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "generate", "generate tokens and show the request's cache facts")
    add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.add_argument(
        "--max-tokens", type=positive_int, default=16, metavar="N", help="tokens to generate"
    )
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 is off")
    parser.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="0 is off")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, metavar="N", help="sampling seed"
    )
    parser.add_argument("--stop-token-ids", default="", metavar="IDS", help="e.g. 2,32000")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--worker", default="", metavar="ID", help="force this worker")
    parser.add_argument("--session", default="", metavar="ID", help="session id (soft affinity)")
    _add_bypass_option(parser)
    parser.set_defaults(handler=commands.run_generate)


def add_route(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "route", "show which worker the router would pick, and the costs")
    add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.add_argument("--session", default="", metavar="ID", help="session id (soft affinity)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
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


def add_lookup(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "lookup", "show how much of a prompt each worker already caches")
    add_client_options(parser, env)
    _add_prompt_options(parser)
    parser.set_defaults(handler=commands.run_lookup)


def add_read_command(
    sub: argparse._SubParsersAction, env: CliEnvironment, name: str, summary: str, run: Handler
) -> None:
    parser = subparser(sub, name, summary)
    add_client_options(parser, env)
    parser.set_defaults(handler=run)


def add_scale(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(
        sub, "scale", "grow or shrink the fleet of workers (admin; shrinking drains first)"
    )
    add_client_options(parser, env)
    parser.add_argument(
        "--workers", type=positive_int, required=True, metavar="N", help="workers alive after"
    )
    parser.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="longest wait for a leaving worker's running streams",
    )
    parser.set_defaults(handler=commands.run_scale)
