"""CLI subcommands whose code lives outside the client, imported only when they are run.

`up` and `serve` need the coordinator, Ray, Redis and the model; `simulate` and `bench` are
optional modules that may be absent from a build. Importing them lazily keeps `kvmesh stats`
fast and lets the read commands work from an install with only the client's dependencies
(the dependency rule `client -> proto` holds at import time).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from types import ModuleType


class NotInThisBuild(Exception):
    """A subcommand's implementation cannot be imported; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Extension:
    """A subcommand whose flags and handler live in an optional module.

    The module provides `add_arguments(parser)` (optional: without it the subcommand takes no
    flags) and the handler named `run_name`, which takes the parsed namespace and returns an
    exit code.
    """

    name: str
    module: str
    run_name: str
    help: str


EXTENSIONS = (
    Extension(
        "simulate",
        "kvmesh.client.simulate_cli",
        "run_simulate",
        "replay a workload through the routing policies in a simulated cluster",
    ),
    Extension("bench", "kvmesh.client.bench", "run_bench", "load-test a running coordinator"),
    Extension(
        "make-trace",
        "kvmesh.client.trace_generator",
        "run_make_trace",
        "write a Mooncake-format trace of a preset shape (reuse, lengths, burstiness)",
    ),
)


@dataclass(frozen=True, slots=True)
class LoadedExtension:
    """The outcome of importing an extension: its module, or the reason it is unavailable."""

    extension: Extension
    module: ModuleType | None
    reason: str


def load_extension(extension: Extension) -> LoadedExtension:
    try:
        module = importlib.import_module(extension.module)
    except ImportError as err:
        return LoadedExtension(extension, None, str(err))
    if not callable(getattr(module, extension.run_name, None)):
        return LoadedExtension(extension, None, f"{extension.module} has no {extension.run_name}")
    return LoadedExtension(extension, module, "")


def run_up(args: argparse.Namespace) -> int:
    """`kvmesh up`, delegated to the coordinator's launcher."""
    try:
        from kvmesh.coordinator.cluster.launcher import run_up as launch
    except ImportError as err:
        raise NotInThisBuild(f"up is not available in this build ({err})") from err
    return launch(args)


def run_serve(args: argparse.Namespace) -> int:
    """`kvmesh serve`, delegated to the coordinator's launcher."""
    try:
        from kvmesh.coordinator.cluster.launcher import run_serve as launch
    except ImportError as err:
        raise NotInThisBuild(f"serve is not available in this build ({err})") from err
    return launch(args)
