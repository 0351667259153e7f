"""The `kvmesh index` subcommands: `verify` (Redis, mirrors and pools compared), `tree` and `top`
(a coordinator's prefix tree)."""

from __future__ import annotations

import argparse

from kvmesh.client import index_tree, index_verify
from kvmesh.client.environment import CliEnvironment
from kvmesh.client.flag_types import non_negative_float, tree_size
from kvmesh.client.help_format import HelpFormatter, subparser
from kvmesh.client.request_parser import add_client_options


def add_index(sub: argparse._SubParsersAction, env: CliEnvironment) -> None:
    parser = subparser(sub, "index", "check the prefix index against the workers' pools")
    actions = parser.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    _add_verify(actions, env)
    _add_tree(actions, env)
    _add_top(actions, env)


def _add_verify(actions: argparse._SubParsersAction, env: CliEnvironment) -> None:
    summary = (
        "compare Redis, each coordinator's mirror and each worker's pool; exit 1 if they differ"
    )
    verify = actions.add_parser(
        "verify", help=summary, description=summary + ".", formatter_class=HelpFormatter
    )
    add_client_options(verify, env, many_addresses=True)
    verify.add_argument(
        "--redis-url",
        default=env.redis_url,
        metavar="URL",
        help="also compare the index in this Redis (env KVMESH_REDIS_URL; default: mirrors"
        " and pools only)",
    )
    verify.add_argument(
        "--wait",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="under traffic the views differ for milliseconds: look again this long before"
        " reporting a difference",
    )
    verify.set_defaults(handler=index_verify.run_index_verify)


def _add_tree(actions: argparse._SubParsersAction, env: CliEnvironment) -> None:
    summary = "show a coordinator's prefix tree: depth, tokens, holders per tier, hits"
    tree = actions.add_parser(
        "tree", help=summary, description=summary + ".", formatter_class=HelpFormatter
    )
    add_client_options(tree, env)
    tree.add_argument(
        "--max-nodes",
        type=tree_size,
        default=1000,
        metavar="N",
        help="show at most N blocks, in tree order (1..100000)",
    )
    tree.set_defaults(handler=index_tree.run_index_tree)


def _add_top(actions: argparse._SubParsersAction, env: CliEnvironment) -> None:
    summary = "show the hottest prefixes (most lookups ended there) and who holds them"
    top = actions.add_parser(
        "top", help=summary, description=summary + ".", formatter_class=HelpFormatter
    )
    add_client_options(top, env)
    top.add_argument(
        "--limit", type=tree_size, default=20, metavar="N", help="show N prefixes (1..100000)"
    )
    top.set_defaults(handler=index_tree.run_index_top)
