"""Coordinator replicas over one fleet: does routing stay as good with 2 and 4 coordinators?

Usage: python benchmarks/replicas.py [--json bench-results/replicas.json] [--trace PATH]
                                     [--seeds 0,1,2,3,4] [--trace-seeds 0,1,2]
                                     [--setups "1,2 log,2 spec"]

The simulator drives the real Coordinator; with `--coordinators K` it runs K of them over the
same simulated workers, arrivals dealt to them in turn. All read the same index mirror, every
worker's own load report (every 500 ms) and the request notes (a coordinator's of each route, a
worker's of each prefill and finish), which reach every replica 1 ms after they are sent (what a
note's trip through a local Redis measured, `benchmarks/note_trip.py`). Two ways to share the
routing state are compared:

  notes   each replica replays its peers' requests into its load tracker only
  log     every decision is committed to one ordered log (compare-and-set on its sequence, one
          1 ms round trip per attempt, added to the request's times); every replica applies the
          log in order to its load tracker and its policy state (`--decision-log`)
  spec    the log with speculative dispatch (`--speculative-dispatch`): a request travels to
          its worker while its commit does; only a redirect (a lost commit whose new decision
          picks another worker) holds it back, by the trips up to the redirect

Per workload and seed: hit rate, pulled share and p90 TTFT, each against one coordinator without
the log on the same seed; printed as the median over the seeds and their range. Goal (issue):
within 5% of one coordinator.
"""

from __future__ import annotations

import argparse
import json
import statistics
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

# (label, coordinators, extra flags); "1" is the baseline every ratio is taken against.
SETUPS = (
    ("1", 1, []),
    ("1 log", 1, ["--decision-log"]),
    ("2 notes", 2, []),
    ("2 log", 2, ["--decision-log"]),
    ("4 notes", 4, []),
    ("4 log", 4, ["--decision-log"]),
    ("1 spec", 1, ["--decision-log", "--speculative-dispatch"]),
    ("2 spec", 2, ["--decision-log", "--speculative-dispatch"]),
    ("4 spec", 4, ["--decision-log", "--speculative-dispatch"]),
)
KEYS = (
    "hit_rate",
    "pulled_rate",
    "ttft_p90_ms",
    "commit_attempts_per_request",
    "commit_ms_mean",
    "redirects_per_request",
)


def simulate(args: list[str], coordinators: int, extra: list[str], seed: int) -> dict[str, float]:
    cmd = ["kvmesh", "simulate", *args, "--policies", "kvmesh", "--json", "--seed", str(seed)]
    cmd += ["--coordinators", str(coordinators), "--note-delay-ms", "1", *extra]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / cmd[0]), *cmd[1:]], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    m = json.loads(out.stdout)["policies"]["kvmesh"]
    return {k: float(m.get(k, 0.0)) for k in KEYS}


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--seeds", type=_seeds, default=[0, 1, 2, 3, 4])
    parser.add_argument("--trace-seeds", type=_seeds, default=[0, 1, 2])
    parser.add_argument(
        "--setups",
        type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
        default=[label for label, _, _ in SETUPS],
        help="which setups to run (comma-separated labels; '1' is always run: the baseline)",
    )
    args = parser.parse_args()
    unknown = set(args.setups) - {label for label, _, _ in SETUPS}
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; choose from {[s[0] for s in SETUPS]}")
    setups = [s for s in SETUPS if s[0] == "1" or s[0] in args.setups]
    runs = {name: (a, args.seeds) for name, a in WORKLOADS.items()}
    if Path(args.trace).exists():
        trace_args = ["--trace", args.trace, "--workers", "8", "--capacity-tokens", "1000000"]
        runs["conversation-trace"] = (trace_args, args.trace_seeds)
    # results[workload][setup][seed] = metrics
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for name, (sim_args, seeds) in runs.items():
        results[name] = {
            label: {str(s): simulate(sim_args, k, extra, s) for s in seeds}
            for label, k, extra in setups
        }
    print(_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def _table(results: dict[str, dict[str, dict[str, dict[str, float]]]]) -> str:
    lines = [
        f"{'workload':19} {'setup':8} {'hit %':>6} {'pulled %':>9} {'p90 TTFT ms':>12}"
        f" {'vs K=1 median [range]':>22} {'commits/req':>12} {'commit ms':>10}"
        f" {'redirects/req':>14}"
    ]
    for name, setups in results.items():
        base = setups["1"]
        for label, by_seed in setups.items():
            ratios = [m["ttft_p90_ms"] / base[s]["ttft_p90_ms"] for s, m in by_seed.items()]

            def med(key: str, by_seed: dict[str, dict[str, float]] = by_seed) -> float:
                return statistics.median(m[key] for m in by_seed.values())

            lines.append(
                f"{name:19} {label:8} {100 * med('hit_rate'):6.2f} {100 * med('pulled_rate'):9.2f}"
                f" {med('ttft_p90_ms'):12.1f} {statistics.median(ratios):8.3f}"
                f" [{min(ratios):.3f}, {max(ratios):.3f}]"
                f" {med('commit_attempts_per_request'):12.3f} {med('commit_ms_mean'):10.3f}"
                f" {med('redirects_per_request'):14.4f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
