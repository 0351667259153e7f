"""Coordinator replicas over one fleet: does routing stay as good with 2 and 4 coordinators?

Usage: python benchmarks/replicas.py [--json bench-results/replicas.json] [--trace PATH]

The simulator drives the real Coordinator; with `--coordinators K` it runs K of them over the
same simulated workers, arrivals dealt to them in turn. Each has its own load tracker and policy
state; all read the same index mirror, every worker's own load report (every 500 ms, as the live
health loop delivers them) and the request notes (a coordinator's of each route, a worker's of
each prefill and finish), which reach every replica `--note-delay-ms` after they are sent: 1 ms
(what a note's trip through a local Redis measured, `benchmarks/note_trip.py`) and 0 (the bound:
replicas that hear each other at once). Printed per workload: hit rate, pulled share and p90
TTFT at 1, 2 and 4 coordinators, each beside the 1-coordinator baseline of the same run.
Goal (issue): within 5% of one coordinator.
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


NOTE_DELAYS_MS = (1.0, 0.0)


def simulate(args: list[str], coordinators: int, note_delay_ms: float) -> dict[str, float]:
    cmd = ["kvmesh", "simulate", *args, "--policies", "kvmesh", "--json"]
    cmd += ["--coordinators", str(coordinators), "--note-delay-ms", f"{note_delay_ms:g}"]
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
    # results[workload][f"{K}@{note delay ms}"]: one coordinator hears only itself (any delay).
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, sim_args in runs.items():
        results[name] = {"1": simulate(sim_args, 1, NOTE_DELAYS_MS[0])}
        for k in (2, 4):
            for delay in NOTE_DELAYS_MS:
                results[name][f"{k}@{delay:g}"] = simulate(sim_args, k, delay)
    header = f"{'workload':20} {'K':>2} {'notes':>6} {'hit %':>7} {'pulled %':>9}"
    print(header + f" {'p90 TTFT ms':>12} {'vs K=1':>8}")
    for name, runs_of in results.items():
        base = runs_of["1"]
        for key, m in runs_of.items():
            k, _, delay = key.partition("@")
            notes = f"{delay} ms" if delay else "-"
            print(
                f"{name:20} {k:>2} {notes:>6} {100 * m['hit_rate']:7.2f}"
                f" {100 * m['pulled_rate']:9.2f} {m['ttft_p90_ms']:12.1f}"
                f" {m['ttft_p90_ms'] / base['ttft_p90_ms']:8.2f}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
