"""The `kvmesh` argument parser: every subcommand, its flags, defaults and help.

Defaults come from `CliEnvironment` (the KVMESH_* variables) so `--help` shows the value a run
would really use. Flag values are range-checked where argparse can name the flag (`flag_types.py`);
request semantics (is this token id in the vocabulary?) are the server's to judge. The subcommands
are built by family: `server_parser.py` (up, serve), `request_parser.py` (generate, route, lookup,
stats, workers, scale), `index_parser.py` (index verify / tree / top), and the extensions here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata

from kvmesh.client import commands, extension
from kvmesh.client.environment import CliEnvironment
from kvmesh.client.extension import Extension, LoadedExtension
from kvmesh.client.help_format import subparser
from kvmesh.client.index_parser import add_index
from kvmesh.client.request_parser import (
    add_generate,
    add_lookup,
    add_read_command,
    add_route,
    add_scale,
)
from kvmesh.client.server_parser import add_serve, add_up


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
    add_up(sub, env)
    add_serve(sub, env)
    add_generate(sub, env)
    add_route(sub, env)
    add_lookup(sub, env)
    add_read_command(sub, env, "stats", "cluster-wide counters", commands.run_stats)
    add_read_command(sub, env, "workers", "list the worker actors", commands.run_workers)
    add_index(sub, env)
    add_scale(sub, env)
    for ext in extensions:
        _add_extension(sub, ext, loaded if loaded is not None and loaded.extension == ext else None)
    return parser


def _version() -> str:
    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


def _add_extension(
    sub: argparse._SubParsersAction, ext: Extension, loaded: LoadedExtension | None
) -> None:
    parser = subparser(sub, ext.name, ext.help)
    if loaded is None:
        return  # not the chosen command: its module stays unimported
    if loaded.module is None:
        parser.description = f"{parser.description} (not available in this build: {loaded.reason})"
        return
    add_arguments = getattr(loaded.module, "add_arguments", None)
    if callable(add_arguments):
        add_arguments(parser)
    parser.set_defaults(handler=getattr(loaded.module, ext.run_name))
