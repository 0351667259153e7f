"""`kvmesh`: the command line for running and querying a kvmesh cluster.

    kvmesh up                          local cluster: embedded Redis, Ray, workers, coordinator
    kvmesh serve --redis-url URL       coordinator on an existing Ray cluster and Redis
    kvmesh generate --tokens 1,2,3     one generation, with its cache facts
    kvmesh route | lookup | stats | workers      read-only views (add --json for scripts)
    kvmesh simulate | bench            router simulator and load generator (when installed)
    kvmesh make-trace --shape NAME     a generated Mooncake-format trace for simulate / bench

Exit codes: 0 success, 1 the server refused or failed the call, 2 bad usage, 130 interrupted.
Errors are one line on stderr (`kvmesh: error: ...`), never a traceback.

Server-side commands import their implementation only when run, so the read commands start fast
and work from an install that has only the client's dependencies.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvmesh.client.environment import read_environment
from kvmesh.client.errors import KVMeshError, Unavailable
from kvmesh.client.extension import EXTENSIONS, NotInThisBuild, load_extension
from kvmesh.client.parser import build_parser

EXIT_OK = 0
EXIT_CALL_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _error(message: str) -> None:
    print(f"kvmesh: error: {message}", file=sys.stderr)


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand in `argv`: the top-level parser takes no option values, so it is the first
    argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def describe_error(err: KVMeshError, address: str | None) -> str:
    """The one-line message for a failed call."""
    if isinstance(err, Unavailable) and err.is_connection_failure and address:
        reason = err.details.rsplit(": ", 1)[-1].strip(" []")
        return (
            f"cannot reach a kvmesh coordinator at {address} ({reason}); "
            "start one with `kvmesh up` or pass --address / set KVMESH_ADDRESS"
        )
    return f"{err.code}: {err.details}" if err.details else err.code


def _parse(argv: list[str]) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code when parsing ended the run (--help, bad usage)."""
    try:
        env = read_environment(os.environ)
    except ValueError as err:
        _error(str(err))
        return EXIT_USAGE
    name = _command_name(argv)
    chosen = next((e for e in EXTENSIONS if e.name == name), None)
    loaded = load_extension(chosen) if chosen is not None else None
    wants_help = "-h" in argv or "--help" in argv
    if loaded is not None and loaded.module is None and not wants_help:
        _error(f"{loaded.extension.name} is not available in this build ({loaded.reason})")
        return EXIT_USAGE
    try:
        return build_parser(env, EXTENSIONS, loaded).parse_args(argv)
    except SystemExit as exit_:
        if exit_.code is None:
            return EXIT_OK
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on `argv` (default: sys.argv[1:]) and return the exit code."""
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    if isinstance(args, int):
        return args
    try:
        return args.handler(args)
    except KVMeshError as err:
        _error(describe_error(err, getattr(args, "address", None)))
        return EXIT_CALL_FAILED
    except NotInThisBuild as err:
        _error(str(err))
        return EXIT_USAGE
    except ValueError as err:
        _error(" ".join(str(err).split()))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (`| head`) went away: stop quietly, and point stdout at /dev/null so the
        # interpreter's final flush does not print a second complaint.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CALL_FAILED


if __name__ == "__main__":
    sys.exit(main())
