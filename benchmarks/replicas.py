"""Coordinator replicas over one fleet: does routing stay as good with 2 and 4 coordinators?

Usage: python benchmarks/replicas.py [--json bench-results/replicas.json] [--trace PATH]

The simulator drives the real Coordinator; with `--coordinators K` it runs K of them over the
same simulated workers, arrivals dealt to them in turn. Each has its own load tracker and policy
state (what it routed itself); all read the same index mirror and every worker's own load report
(every 500 ms, as the live health loop delivers them). Printed per workload: hit rate, pulled
share and p90 TTFT at 1, 2 and 4 coordinators, each beside the 1-coordinator baseline of the
same run. Goal (issue): within 5% of one coordinator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKLOADS = {
    "shared-prefix": [
        "--workload",
        "shared_prefix",
        "--workers",
        "8",
        "--capacity-tokens",
        "65536",
    ],
    "multi-turn": ["--workload", "multi_turn", "--workers", "8", "--capacity-tokens", "65536"],
}
TRACE = "../shared/traces/conversation_trace.jsonl"


def simulate(args: list[str], coordinators: int) -> dict[str, float]:
    cmd = ["kvmesh", "simulate", *args, "--policies", "kvmesh", "--json"]
    cmd += ["--coordinators", str(coordinators)]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / cmd[0]), *cmd[1:]], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    doc = json.loads(out.stdout)
    m = doc["policies"]["kvmesh"]
    return {k: float(m[k]) for k in ("hit_rate", "pulled_rate", "ttft_p90_ms", "imbalance")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", default=TRACE)
    args = parser.parse_args()
    runs = dict(WORKLOADS)
    if Path(args.trace).exists():
        runs["conversation-trace"] = [
            "--trace", args.trace, "--workers", "8", "--capacity-tokens", "1000000",
        ]  # fmt: skip
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name, sim_args in runs.items():
        results[name] = {k: simulate(sim_args, k) for k in (1, 2, 4)}
    print(
        f"{'workload':20} {'K':>2} {'hit %':>7} {'pulled %':>9} {'p90 TTFT ms':>12} {'vs K=1':>8}"
    )
    for name, by_k in results.items():
        base = by_k[1]["ttft_p90_ms"]
        for k, m in by_k.items():
            print(
                f"{name:20} {k:>2} {100 * m['hit_rate']:7.2f} {100 * m['pulled_rate']:9.2f}"
                f" {m['ttft_p90_ms']:12.1f} {m['ttft_p90_ms'] / base:8.2f}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
