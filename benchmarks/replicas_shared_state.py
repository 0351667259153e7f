"""Which per-replica state costs coordinator replicas their p90 TTFT? An upper-bound experiment.

Usage: python benchmarks/replicas_shared_state.py [--json bench-results/replicas_shared_state.json]

Runs the simulator's K coordinators (as `kvmesh simulate --coordinators K` does) with their
request notes switched off (they never land), then hands every replica the *same* objects for
part of the routing state, which no deployment could do (replicas are separate processes): what
sharing that state could buy at most, and so which state is the cause. Shared, in turn: nothing;
the load tracker (queued prefill, running requests); the load tracker plus the kvmesh policy's
recent-placement sums and running context; the whole policy and the load tracker (then K
replicas route exactly as one does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.client import simulate_cli
from kvmesh.client.workload_options import load_requests
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests

WORKLOADS = {
    "shared-prefix": ["--workload", "shared_prefix", "--capacity-tokens", "65536"],
    "multi-turn": ["--workload", "multi_turn", "--capacity-tokens", "65536"],
    "conversation-trace": [
        "--trace",
        "../shared/traces/conversation_trace.jsonl",
        "--capacity-tokens",
        "1000000",
    ],  # fmt: skip
}
SHARES = {
    "nothing": (),
    "load": ("load",),
    "load+recent+running": ("load", "_recent", "_running"),
    "policy+load": ("load", "policy"),
}


def run(sim_args: list[str], k: int, shared: tuple[str, ...]) -> dict[str, float]:
    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    args = parser.parse_args([*sim_args, "--workers", "8"])
    block_size = args.block_size or (args.trace_block_size if args.trace else 16)
    config = SimConfig(8, args.capacity_tokens, block_size, num_coordinators=k, note_delay_ms=1e12)
    sim = ClusterSimulation(config, "kvmesh", prepare_requests(load_requests(args), block_size))
    first = sim.coordinators[0]
    for other in sim.coordinators[1:]:
        for name in shared:
            if name.startswith("_"):
                setattr(other.policy, name, getattr(first.policy, name))
            else:
                setattr(other, name, getattr(first, name))
    r = sim.run()
    return {"hit_rate": r.hit_rate, "pulled_rate": r.pulled_rate, "ttft_p90_ms": r.ttft_p90_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'workload':20} {'K':>2} {'shared':20} {'hit %':>7} {'p90 TTFT ms':>12} {'vs K=1':>7}")
    for name, sim_args in WORKLOADS.items():
        if "--trace" in sim_args and not Path(sim_args[1]).exists():
            continue
        base = run(sim_args, 1, ())
        results[name] = {"1": base}
        for k in (2, 4):
            for label, shared in SHARES.items():
                m = results[name][f"{k}/{label}"] = run(sim_args, k, shared)
                print(
                    f"{name:20} {k:>2} {label:20} {100 * m['hit_rate']:7.2f}"
                    f" {m['ttft_p90_ms']:12.1f} {m['ttft_p90_ms'] / base['ttft_p90_ms']:7.2f}",
                    flush=True,
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
