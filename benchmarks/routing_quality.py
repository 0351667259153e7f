"""Routing quality: run every `kvmesh simulate` comparison of docs/benchmarks.md, print its tables.

Usage: python benchmarks/routing_quality.py [--only NAME ...] [--reuse] [--plots docs/img]

Each run is one `kvmesh simulate ... --json` command (printed above its table, so a reader can
rerun it alone); its JSON is kept under bench-results/routing/NAME.json, and `--reuse` rebuilds
the tables from those files without simulating again. The trace runs need
../shared/traces/conversation_trace.jsonl (or --trace PATH).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

TRACE = "../shared/traces/conversation_trace.jsonl"
GENERATED = ("shared_prefix", "multi_turn", "rag", "agentic")


def runs(trace: str) -> dict[str, list[str]]:
    """NAME -> `kvmesh simulate` arguments (without --json / --plot)."""
    t = ["--trace", trace, "--capacity-tokens", "1000000"]
    out = {
        "trace-8w": [*t, "--workers", "8"],
        "trace-8w-no-pulls": [*t, "--workers", "8", "--no-pulls"],
        "trace-64w": [*t, "--workers", "64", "--scale-roots", "8"],
        "trace-256w": [*t, "--workers", "256", "--scale-roots", "32", "--max-requests", "64000"],
    }
    for name in GENERATED:
        g = ["--workload", name, "--workers", "8", "--capacity-tokens", "65536"]
        out[name.replace("_", "-")] = g
        out[name.replace("_", "-") + "-no-pulls"] = [*g, "--no-pulls", "--policies", "kvmesh"]
    return out


def simulate(name: str, args: list[str], results: Path, plots: str | None) -> dict:
    cmd = [sys.executable, "-m", "kvmesh.client.cli", "simulate", *args, "--json"]
    if plots and "--no-pulls" not in args:
        cmd += ["--plot", plots]
    print(f"# running {name}: {shlex.join(cmd[3:])}", file=sys.stderr, flush=True)
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    (results / f"{name}.json").write_text(json.dumps(doc, indent=2))
    return doc


def table(doc: dict) -> str:
    oracle = doc["policies"].get("oracle", {}).get("hit_rate", 0.0)
    lines = [
        "| policy | local hit % | pulled % | reuse / oracle | TTFT p50 ms | p90 ms | p99 ms "
        "| req/s | imbalance | decisions/s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, m in doc["policies"].items():
        reuse = m["hit_rate"] + m["pulled_rate"]
        ratio = f"{reuse / oracle:.2f}" if oracle else "-"
        label = f"**{name}**" if name == "kvmesh" else name
        lines.append(
            f"| {label} | {100 * m['hit_rate']:.1f} | {100 * m['pulled_rate']:.1f} | {ratio} "
            f"| {m['ttft_p50_ms']:.1f} | {m['ttft_p90_ms']:.1f} | {m['ttft_p99_ms']:.1f} "
            f"| {m['throughput_rps']:.2f} | {m['imbalance']:.3f} | {m['decisions_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run names (default: all)")
    parser.add_argument("--reuse", action="store_true", help="tables from saved JSON only")
    parser.add_argument("--plots", metavar="DIR", help="also write PNG charts into DIR")
    parser.add_argument("--trace", default=TRACE, help="Mooncake-format trace")
    parser.add_argument("--results", default="bench-results/routing", help="JSON folder")
    args = parser.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    for name, sim_args in runs(args.trace).items():
        if args.only and name not in args.only:
            continue
        saved = results / f"{name}.json"
        if args.reuse and saved.exists():
            doc = json.loads(saved.read_text())
        else:
            doc = simulate(name, sim_args, results, args.plots)
        print(f"\n### {name}\n\n`kvmesh simulate {shlex.join(sim_args)}`\n")
        print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
