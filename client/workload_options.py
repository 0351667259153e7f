"""Command-line options that pick a workload (`--workload` or `--trace`), shared by
`kvmesh simulate` and `kvmesh bench`, and the requests they name."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from kvmesh.client import trace_replay, workloads
from kvmesh.client.flag_types import positive_float, positive_int
from kvmesh.client.workloads import WorkloadRequest

DEFAULT_TRACE_BLOCK_SIZE = 512
# The SLO goodput counts against, in `simulate` and `bench` alike (the simulator's `Slo` has the
# same defaults; the client cannot import it).
DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TPOT_MS = 100.0


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--trace / --workload and their knobs (shared with `kvmesh bench`)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="PATH", help="Mooncake-format trace (JSON lines)")
    source.add_argument(
        "--workload", choices=sorted(workloads.WORKLOADS), help="generated workload"
    )
    parser.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the workload's config, e.g. num_groups=32 "
        "(repeatable; default: none)",
    )
    parser.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=DEFAULT_TRACE_BLOCK_SIZE,
        metavar="TOKENS",
        help="tokens each hash id of the trace stands for",
    )
    parser.add_argument(
        "--speedup", type=positive_float, default=1.0, help="compress trace arrivals by this"
    )
    parser.add_argument(
        "--max-requests", type=positive_int, default=None, metavar="N", help="stop after N"
    )
    parser.add_argument(
        "--scale-roots",
        type=positive_int,
        default=1,
        metavar="K",
        help="K disjoint copies of the trace's prefix roots (K x the load, for large clusters)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and tie-breaking seed")


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """--slo-ttft-ms / --slo-tpot-ms: what a request must meet to count towards goodput."""
    parser.add_argument(
        "--slo-ttft-ms",
        type=positive_float,
        default=DEFAULT_SLO_TTFT_MS,
        metavar="MS",
        help=f"goodput counts requests with TTFT at most this (default: {DEFAULT_SLO_TTFT_MS:g})",
    )
    parser.add_argument(
        "--slo-tpot-ms",
        type=positive_float,
        default=DEFAULT_SLO_TPOT_MS,
        metavar="MS",
        help=f"... and time per output token at most this (default: {DEFAULT_SLO_TPOT_MS:g})",
    )


def load_requests(
    args: argparse.Namespace, vocab_size: int | None = None
) -> Iterable[WorkloadRequest]:
    """The requests `--trace` / `--workload` name (a trace is read lazily)."""
    overrides: dict[str, Any] = dict(workloads.parse_overrides(args.workload_arg))
    if args.trace:
        if overrides:
            raise ValueError("--workload-arg applies to --workload, not to --trace")
        config = trace_replay.TraceReplayConfig(
            block_size=args.trace_block_size,
            speedup=args.speedup,
            max_requests=args.max_requests,
            scale_roots=args.scale_roots,
            **({"vocab_size": vocab_size} if vocab_size else {}),
        )
        return trace_replay.replay_file(args.trace, config)
    if vocab_size:
        overrides.setdefault("vocab_size", vocab_size)
    requests = workloads.generate(args.workload, args.seed, overrides)
    return requests[: args.max_requests] if args.max_requests else requests
