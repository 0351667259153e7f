"""`kvmesh simulate`: replay a workload or a trace through every routing policy, side by side.

    kvmesh simulate --trace PATH --workers 8 --capacity-tokens 1000000 --json
    kvmesh simulate --workload shared_prefix --workers 8 --capacity-tokens 65536 --plot docs/img

The workload (generated here, or read from a Mooncake-format trace) is built on the client side;
the simulation engine (`kvmesh.coordinator.sim.simulator`: the real router, index mirror and block
pools) is imported only when the command runs, so the client's import rule (`client -> proto`)
holds and a client-only install reports the command as unavailable instead of failing to start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.client import workloads
from kvmesh.client.extension import NotInThisBuild
from kvmesh.client.flag_types import positive_int
from kvmesh.client.table import format_table
from kvmesh.client.workload_options import (
    DEFAULT_TRACE_BLOCK_SIZE,
    add_slo_arguments,
    add_workload_arguments,
    load_requests,
)

DEFAULT_WORKLOAD_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--workers", type=positive_int, default=8, help="simulated workers")
    parser.add_argument(
        "--capacity-tokens",
        type=positive_int,
        required=True,
        metavar="T",
        help="KV capacity of each worker, in tokens",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="KV block size (default: the trace's block size, 16 for generated workloads)",
    )
    parser.add_argument(
        "--policies", default="all", metavar="A,B,...", help="policies to compare, or all"
    )
    parser.add_argument(
        "--cost-model", metavar="FILE", help="JSON object overriding the compute cost model"
    )
    parser.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one cost-model field, e.g. prefill_per_token_ms=0.03 "
        "(repeatable; default: none)",
    )
    parser.add_argument(
        "--no-pulls",
        action="store_true",
        help="workers cannot pull prefixes from each other (kvmesh then only recomputes)",
    )
    parser.add_argument(
        "--coordinators",
        type=positive_int,
        default=1,
        help="coordinator replicas sharing the fleet (arrivals go to them in turn)",
    )
    parser.add_argument(
        "--report-interval-ms",
        type=float,
        default=500.0,
        metavar="MS",
        help="how often workers' load reports reach the coordinators",
    )
    parser.add_argument(
        "--note-delay-ms",
        type=float,
        default=1.0,
        metavar="MS",
        help="how long request notes (routes, prefills, finishes) take to reach the coordinators",
    )
    parser.add_argument(
        "--decision-log",
        action="store_true",
        help="replicas commit every decision to one ordered log and apply each other's from it",
    )
    parser.add_argument(
        "--commit-trip-ms",
        type=float,
        default=1.0,
        metavar="MS",
        help="a decision-log commit's round trip, added per attempt to the request's times",
    )
    parser.add_argument(
        "--speculative-dispatch",
        action="store_true",
        help="with --decision-log: a request travels to its worker while its commit does; only"
        " a redirect (a lost commit that moves it) costs it the trips before it",
    )
    add_slo_arguments(parser)
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run_simulate(args: argparse.Namespace) -> int:
    try:
        from kvmesh.coordinator.sim import simulator
        from kvmesh.coordinator.sim.cost_model import SimCostModel
        from kvmesh.coordinator.sim.report import Slo
    except ImportError as err:
        raise NotInThisBuild(f"simulate is not available in this build ({err})") from err
    cost = SimCostModel.from_json(args.cost_model) if args.cost_model else SimCostModel()
    cost = SimCostModel.from_mapping(workloads.parse_overrides(args.cost), cost)
    names = simulator.policy_names(args.policies)
    default_block = DEFAULT_TRACE_BLOCK_SIZE if args.trace else DEFAULT_WORKLOAD_BLOCK_SIZE
    block_size = args.block_size or (args.trace_block_size if args.trace else default_block)
    config = simulator.SimConfig(
        args.workers,
        args.capacity_tokens,
        block_size,
        args.seed,
        cost,
        not args.no_pulls,
        Slo(args.slo_ttft_ms, args.slo_tpot_ms),
        num_coordinators=args.coordinators,
        report_interval_ms=args.report_interval_ms,
        note_delay_ms=args.note_delay_ms,
        decision_log=args.decision_log,
        commit_trip_ms=args.commit_trip_ms,
        speculative_dispatch=args.speculative_dispatch,
    )
    start = time.perf_counter()
    requests = simulator.prepare_requests(load_requests(args), block_size)
    if not requests:
        raise ValueError("the workload has no requests")
    _progress(f"prepared {len(requests)} requests in {time.perf_counter() - start:.1f} s")

    def done(result: Any) -> None:
        _progress(f"simulated {result.policy} in {result.wall_s:.1f} s")

    results = simulator.simulate(config, requests, names, done)
    source = args.trace or args.workload
    if args.plot:
        from kvmesh.coordinator.sim.plots import write_plots

        stem = f"{Path(source).stem.replace('_', '-')}-{args.workers}w"
        title = f"{Path(source).name}, {args.workers} workers"
        for path in write_plots(results, args.plot, stem, title):
            _progress(f"wrote {path}")
    if args.json:
        print(json.dumps(_document(results, config, source, len(requests)), indent=2))
    else:
        print(_table(results))
    return 0


def _progress(message: str) -> None:
    print(f"kvmesh simulate: {message}", file=sys.stderr, flush=True)


def _document(results: dict[str, Any], config: Any, source: str, num_requests: int) -> dict:
    return {
        "policies": {name: _metrics(r, config) for name, r in results.items()},
        "config": {
            "source": source,
            "num_requests": num_requests,
            "workers": config.num_workers,
            "capacity_tokens": config.capacity_tokens,
            "block_size": config.block_size,
            "seed": config.seed,
            "pulls": config.pulls,
            "slo": {"ttft_ms": config.slo.ttft_ms, "tpot_ms": config.slo.tpot_ms},
            "cost_model": config.cost.as_dict(),
        },
    }


def _metrics(result: Any, config: Any) -> dict[str, float]:
    metrics = result.metrics()
    if config.decision_log:
        metrics["commit_attempts_per_request"] = result.commit_attempts_per_request
        metrics["commit_ms_mean"] = result.commit_ms_mean
        metrics["redirects_per_request"] = result.redirects_per_request
    return metrics


def _table(results: dict[str, Any]) -> str:
    oracle = results.get("oracle")
    headers = ["policy", "hit %", "vs oracle", "pulled %", "ttft p50", "p90", "p99"]
    headers += ["tpot p50", "p90", "e2e p50", "p90", "p99", "req/s", "goodput", "imbalance"]
    headers += ["decisions/s"]
    rows = []
    for name, r in results.items():
        ratio = r.hit_rate / oracle.hit_rate if oracle is not None and oracle.hit_rate else None
        rows.append(
            [
                name,
                100 * r.hit_rate,
                ratio,
                100 * r.pulled_rate,
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.ttft_p99_ms,
                r.tpot_p50_ms,
                r.tpot_p90_ms,
                r.e2e_p50_ms,
                r.e2e_p90_ms,
                r.e2e_p99_ms,
                r.throughput_rps,
                r.goodput_rps,
                r.imbalance,
                round(r.decisions_per_s),
            ]
        )
    return format_table(headers, rows) + (
        "\n(hit: share of prompt tokens reused; times in ms; goodput: requests/s that met the SLO)"
    )
