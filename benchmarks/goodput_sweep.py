"""Goodput under rising load: the arrival rate at which each policy stops meeting its SLO.

Usage: python benchmarks/goodput_sweep.py --workload hot_prefix --capacity-tokens 262144
                                          --rates 40 60 80 [--seeds 0 1 2] [--policies A,B]
                                          [--workers 8] [--jobs 2] [--reuse] [--update A,B]

At the rates of the routing-quality tables nearly every request of every cache-aware policy
meets the SLO, so goodput equals throughput and cannot separate them. Here one generated
workload is simulated at each rate (`--workload-arg rate_rps=R`, the same requests arriving
faster) and seed; per policy the table gives the SLO attainment (goodput / throughput, median
over the seeds, spread beside it) at each rate, and the **knee**: the lowest rate whose median
attainment is under 90%. Each run is one `kvmesh simulate ... --json` command (printed); its
JSON is kept under bench-results/sweep/ (the published tables' under docs/data/sweep/, with
`--results`), and `--reuse` rebuilds the table from those files;
`--update kvmesh` simulates kvmesh again and keeps the other policies from the saved files.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KNEE = 0.9
"""Attainment under which a policy no longer keeps up (goodput < 90% of throughput)."""


def simulate(args: argparse.Namespace, rate: float, seed: int, results: Path) -> dict:
    saved = results / f"{args.workload}-{args.capacity_tokens}-r{rate:g}-s{seed}.json"
    if args.reuse and saved.exists():
        return json.loads(saved.read_text())
    policies = args.update or args.policies
    cmd = [
        *(sys.executable, "-m", "kvmesh.client.cli", "simulate"),
        *("--workload", args.workload, "--workers", str(args.workers)),
        *("--capacity-tokens", str(args.capacity_tokens), "--seed", str(seed)),
        *("--workload-arg", f"rate_rps={rate:g}", "--policies", policies, "--json"),
    ]
    print(f"# running: {shlex.join(cmd[3:])}", file=sys.stderr, flush=True)
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if args.update:
        if not saved.exists():
            raise SystemExit(f"--update needs the other policies' results in {saved}")
        merged = json.loads(saved.read_text())  # the other policies' results stand
        merged["policies"].update(doc["policies"])
        doc = merged
    saved.write_text(json.dumps(doc, indent=2))
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, help="a generated workload with rate_rps")
    parser.add_argument("--capacity-tokens", type=int, required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rates", nargs="+", type=float, required=True, help="requests/s")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--policies", default="kvmesh,least_loaded,session_sticky,sglang,dynamo")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once")
    parser.add_argument("--reuse", action="store_true", help="table from saved JSON only")
    parser.add_argument("--update", metavar="A,B", help="simulate only these; others from JSON")
    parser.add_argument("--results", default="bench-results/sweep", help="JSON folder")
    args = parser.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    jobs = [(r, s) for r in args.rates for s in args.seeds]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        docs = list(pool.map(lambda job: simulate(args, job[0], job[1], results), jobs))
    by_job = dict(zip(jobs, docs, strict=True))
    policies = [p for p in docs[0]["policies"] if p != "oracle"]
    rates = " ".join(f"{r:g}" for r in args.rates)
    seeds = " ".join(str(s) for s in args.seeds)
    print(
        f"\nrates {rates}, seeds {seeds}: `kvmesh simulate --workload {args.workload} --workers"
        f" {args.workers} --capacity-tokens {args.capacity_tokens} --workload-arg rate_rps=RATE"
        f" --policies {args.policies} --seed SEED`\n"
    )
    print("| policy | " + " | ".join(f"{r:g} req/s" for r in args.rates) + " | knee |")
    print("|---|" + "--:|" * (len(args.rates) + 1))
    for policy in policies:
        cells, knee = [], None
        for rate in args.rates:
            shares = [by_job[(rate, s)]["policies"][policy]["slo_attainment"] for s in args.seeds]
            median = statistics.median(shares)
            cells.append(f"{100 * median:.1f}% ({100 * (max(shares) - min(shares)):.1f})")
            if knee is None and median < KNEE:
                knee = rate
        label = f"**{policy}**" if policy == "kvmesh" else policy
        shown = f"{knee:g} req/s" if knee is not None else f"> {args.rates[-1]:g} req/s"
        print(f"| {label} | " + " | ".join(cells) + f" | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
