"""Routing quality: every `kvmesh simulate` comparison of docs/benchmarks.md over several seeds.

Usage: python benchmarks/routing_quality.py [--only NAME ...] [--seeds 0 1 2] [--jobs 2]
                                            [--reuse] [--plots docs/img] [--policies A,B]

Each run is one `kvmesh simulate ... --seed S --json` command per seed (printed above its table,
so a reader can rerun one alone); its JSON is kept under bench-results/routing/NAME-sS.json, and
`--reuse` rebuilds the tables from those files without simulating again; `--policies kvmesh`
simulates only the named policies and takes every other one from the saved file of the same run
and seed (after a change that touches one policy, the others' results stand). The JSON of the
published tables is under docs/data/routing/ (`--results docs/data/routing` reads it; the
traces are still written under bench-results/traces). Generated traces are
written first with `kvmesh make-trace --shape SHAPE --seed S` (a seed is a different trace); on
the conversation trace the seed moves only the policies' tie-breaking. The trace runs need
../shared/traces/conversation_trace.jsonl (or --trace PATH).

Every figure is the median over the seeds, with the spread (max - min) beside it. The goals are
checked for kvmesh against the best other policy: a difference smaller than the larger of the two
spreads is a tie, not a win or a loss.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TRACE = "../shared/traces/conversation_trace.jsonl"
SHAPES = ("low_reuse_docs", "bursty_agents", "long_context")
WORKLOADS = ("hot_prefix", "shared_prefix", "multi_turn", "rag", "agentic")
SEED = "{seed}"  # replaced per run


@dataclass(frozen=True, slots=True)
class Run:
    """One comparison: simulate arguments (SEED marks the seed) and the trace it needs."""

    args: tuple[str, ...]
    shape: str = ""
    """Generated trace shape to write first (bench-results/traces/SHAPE-sSEED.jsonl)."""


def runs(trace: str, traces: Path) -> dict[str, Run]:
    big = ("--capacity-tokens", "1000000", "--workers", "8")
    out = {
        "trace-8w": Run(("--trace", trace, *big, "--max-requests", "4000", "--seed", SEED)),
    }
    for shape in SHAPES:
        path = str(traces / f"{shape}-s{SEED}.jsonl")
        out[shape.replace("_", "-")] = Run(("--trace", path, *big), shape)
    small = ("--workers", "8", "--capacity-tokens", "65536", "--seed", SEED)
    for name in WORKLOADS:
        out[name.replace("_", "-")] = Run(("--workload", name, *small))
    # hot_prefix's prompts are long (~5K tokens): 256K tokens (32 GiB of KV, what an 80 GB H100
    # holds beside an 8B model's weights) is its main run; 64K starves it of memory.
    out["hot-prefix-small-kv"] = out.pop("hot-prefix")
    out["hot-prefix"] = Run(
        (
            "--workload",
            "hot_prefix",
            "--workers",
            "8",
            "--capacity-tokens",
            "262144",
            "--seed",
            SEED,
        )
    )
    out["hot-prefix-64w"] = Run(
        (
            *("--workload", "hot_prefix", "--workers", "64", "--capacity-tokens", "262144"),
            *("--workload-arg", "num_requests=9600", "--workload-arg", "rate_rps=320"),
            *("--policies", "kvmesh,least_loaded,sglang,dynamo", "--seed", SEED),
        )
    )
    return out


def _with_seed(args: tuple[str, ...], seed: int) -> list[str]:
    return [a.replace(SEED, str(seed)) for a in args]


def simulate(
    name: str,
    run: Run,
    seed: int,
    results: Path,
    plots: str | None,
    policies: str | None = None,
) -> dict:
    """One seed of one run; with `policies`, only those are simulated and the rest are kept
    from the saved file (which must exist), in its order."""
    saved = results / f"{name}-s{seed}.json"
    args = _with_seed(run.args, seed)
    if run.shape:
        trace = args[args.index("--trace") + 1]
        make = ["make-trace", "--shape", run.shape, "--seed", str(seed), "--out", trace]
        subprocess.run([sys.executable, "-m", "kvmesh.client.cli", *make], check=True, text=True)
    cmd = [sys.executable, "-m", "kvmesh.client.cli", "simulate", *args, "--json"]
    if policies:
        cmd += ["--policies", policies]  # the last --policies wins over the run's own
    elif plots and seed == 0:
        cmd += ["--plot", plots]  # charts compare every policy: only from a full run
    print(f"# running {name} seed {seed}: {shlex.join(cmd[3:])}", file=sys.stderr, flush=True)
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if policies:
        if not saved.exists():
            raise SystemExit(f"--policies needs the other policies' results in {saved}")
        merged = json.loads(saved.read_text())
        merged["policies"].update(doc["policies"])
        doc = merged
    saved.write_text(json.dumps(doc, indent=2))
    return doc


@dataclass(frozen=True, slots=True)
class Stat:
    median: float
    spread: float

    def show(self, fmt: str) -> str:
        return f"{self.median:{fmt}} ({self.spread:{fmt}})"


def fold(docs: list[dict]) -> dict[str, dict[str, Stat]]:
    """policy -> metric -> median and spread over the seeds (reuse_vs_oracle added)."""
    out: dict[str, dict[str, Stat]] = {}
    for policy in docs[0]["policies"]:
        samples: dict[str, list[float]] = {}
        for doc in docs:
            m = dict(doc["policies"][policy])
            oracle = doc["policies"]["oracle"]["hit_rate"]
            m["reuse_vs_oracle"] = (m["hit_rate"] + m["pulled_rate"]) / oracle if oracle else 1.0
            for k, v in m.items():
                samples.setdefault(k, []).append(float(v))
        out[policy] = {k: Stat(statistics.median(v), max(v) - min(v)) for k, v in samples.items()}
    return out


COLUMNS = (  # metric, header, format
    ("reuse_vs_oracle", "reuse / oracle", ".2f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
    ("ttft_p90_ms", "TTFT p90 ms", ".0f"),
    ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
    ("tpot_p90_ms", "TPOT p90 ms", ".1f"),
    ("e2e_p90_ms", "E2E p90 ms", ".0f"),
    ("e2e_p99_ms", "E2E p99 ms", ".0f"),
    ("goodput_rps", "goodput req/s", ".2f"),
    ("imbalance", "imbalance", ".3f"),
)


def table(stats: dict[str, dict[str, Stat]]) -> str:
    lines = [
        "| policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|" + "--:|" * len(COLUMNS),
    ]
    for name, m in stats.items():
        label = f"**{name}**" if name == "kvmesh" else name
        cells = [m[k].show(fmt) for k, _, fmt in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(stats: dict[str, dict[str, Stat]]) -> list[str]:
    """kvmesh against the best other policy (the oracle is a bound, not a competitor)."""
    k = stats["kvmesh"]
    others = {n: m for n, m in stats.items() if n not in ("kvmesh", "oracle")}
    out = []
    for metric, higher, slack in (
        ("goodput_rps", True, 0.0),
        ("ttft_p90_ms", False, 0.03),
        ("tpot_p90_ms", False, 0.03),
    ):
        pick = max if higher else min
        best_name = pick(others, key=lambda n: others[n][metric].median)
        best, mine = others[best_name][metric], k[metric]
        gap = (mine.median - best.median) * (1 if higher else -1)  # > 0: kvmesh better
        spread = max(mine.spread, best.spread)
        if gap >= -slack * abs(best.median):
            verdict = "met"
        elif -gap < spread:
            verdict = "tie"
        else:
            verdict = "missed"
        out.append(
            f"{metric}: {verdict} (kvmesh {mine.median:.4g}, best other {best_name} "
            f"{best.median:.4g}, spread {spread:.3g})"
        )
    imb, reuse = k["imbalance"].median, k["reuse_vs_oracle"].median
    out.append(f"imbalance <= 1.25: {'met' if imb <= 1.25 else 'missed'} ({imb:.3f})")
    out.append(f"reuse >= 0.95 x oracle: {'met' if reuse >= 0.95 else 'missed'} ({reuse:.2f})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run names (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once")
    parser.add_argument("--reuse", action="store_true", help="tables from saved JSON only")
    parser.add_argument("--plots", metavar="DIR", help="also write PNG charts (seed 0) into DIR")
    parser.add_argument("--trace", default=TRACE, help="Mooncake-format trace")
    parser.add_argument("--results", default="bench-results/routing", help="JSON folder")
    parser.add_argument(
        "--policies", metavar="A,B", help="simulate only these; the others from the saved JSON"
    )
    args = parser.parse_args()
    results = Path(args.results)
    traces = Path("bench-results/traces")
    results.mkdir(parents=True, exist_ok=True)
    traces.mkdir(parents=True, exist_ok=True)
    chosen = {n: r for n, r in runs(args.trace, traces).items() if not args.only or n in args.only}

    def one(job: tuple[str, int]) -> dict:
        name, seed = job
        saved = results / f"{name}-s{seed}.json"
        if args.reuse and saved.exists():
            return json.loads(saved.read_text())
        return simulate(name, chosen[name], seed, results, args.plots, args.policies)

    jobs = [(n, s) for n in chosen for s in args.seeds]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        docs = dict(zip(jobs, pool.map(one, jobs), strict=True))
    for name, run in chosen.items():
        stats = fold([docs[(name, s)] for s in args.seeds])
        seeds = " ".join(str(s) for s in args.seeds)
        command = " ".join(a.replace(SEED, "SEED") for a in run.args)  # no spaces to quote
        print(f"\n### {name}\n\nseeds {seeds}: `kvmesh simulate {command}`\n")
        print(table(stats))
        print("\n" + "\n".join(f"- {g}" for g in goals(stats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
