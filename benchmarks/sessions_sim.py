"""Warm idle sessions in the simulator: kvmesh's reuse and TTFT with and without them.

    python benchmarks/sessions_sim.py --workloads multi_turn,agentic --capacities 16384,32768 \
        --seeds 0,1,2 --json bench-results/sessions.json

Every run drives the real Coordinator (kvmesh policy) over 8 simulated workers whose pools are
the real `BlockPool`; "warm" runs add the real `WarmSessions` to every worker. The table gives
the median over the seeds of the prompt tokens reused (local + pulled) and of p90 TTFT.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from result_rows import write_rows

from kvmesh.client import workloads
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig


def run_one(
    workload: str,
    capacity: int,
    seed: int,
    sessions: WarmSessionConfig | None,
    host_tokens: int,
    policy: str,
) -> dict[str, Any]:
    config = SimConfig(8, capacity, 16, seed, sessions=sessions, host_capacity_tokens=host_tokens)
    requests = prepare_requests(workloads.generate(workload, seed), 16)
    sim = ClusterSimulation(config, policy, requests)
    result = sim.run()
    warm = [w.sessions.stats() for w in sim.workers if w.sessions is not None]
    host_hits = sum(sim.backend.host_tokens)
    return {
        "reuse": (result.cached_tokens + result.pulled_tokens) / result.prompt_tokens,
        "host_share": host_hits / result.prompt_tokens,
        "p90_ms": result.ttft_p90_ms,
        "p50_ms": result.ttft_p50_ms,
        "evicted_ttl": sum(s.num_evicted_ttl for s in warm),
        "evicted_budget": sum(s.num_evicted_budget for s in warm),
        "evicted_pressure": sum(s.num_evicted_pressure for s in warm),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="multi_turn,agentic")
    p.add_argument("--capacities", default="16384,32768")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policy", default="kvmesh")
    p.add_argument("--ttl-s", type=float, default=60.0)
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument(
        "--host-factor", type=float, default=4.0, help="host tier = this x device capacity"
    )
    p.add_argument("--variants", default="today,warm,host,warm+host")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    warm = WarmSessionConfig(idle_ttl_s=args.ttl_s, budget_fraction=args.budget_fraction)
    rows = []
    for workload in args.workloads.split(","):
        for capacity in (int(c) for c in args.capacities.split(",")):
            for name in args.variants.split(","):
                sessions = warm if "warm" in name else None
                host = int(capacity * args.host_factor) if "host" in name else 0
                runs = [
                    run_one(workload, capacity, int(s), sessions, host, args.policy)
                    for s in args.seeds.split(",")
                ]
                row = {"workload": workload, "capacity": capacity, "variant": name, "runs": runs}
                row["reuse"] = statistics.median(r["reuse"] for r in runs)
                row["p90_ms"] = statistics.median(r["p90_ms"] for r in runs)
                row["host_share"] = statistics.median(r["host_share"] for r in runs)
                rows.append(row)
                print(
                    f"{workload:11s} {capacity:6d} {name:9s} reuse {row['reuse']:.1%}"
                    f" (host {row['host_share']:.1%})"
                    f"  p90 {row['p90_ms']:8.1f} ms  "
                    + " ".join(
                        f"ttl/budget/pressure {r['evicted_ttl']}/{r['evicted_budget']}"
                        f"/{r['evicted_pressure']}"
                        for r in runs[:1]
                    ),
                    flush=True,
                )
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
