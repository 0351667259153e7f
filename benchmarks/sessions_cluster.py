"""Warm idle sessions on a real CPU cluster: reuse with and without them, at several pool sizes.

    python benchmarks/sessions_cluster.py --num-blocks 192,320 \
        --json bench-results/sessions_cluster.json

Each run starts a fresh deployment in-process (real Redis, real local Ray, two `tiny-random`
workers on the CPU) with `--session-budget` 0 (warm sessions off) or the given share, and drives
it with `kvmesh bench` over the `chat_beside_batch` workload scaled to the CPU: chats whose turns
come seconds apart beside a stream of one-off documents that churn each worker's pool faster than
a chat returns. Reuse is the share of prompt tokens the workers report as cached or pulled.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from local_ray import start_local_ray
from result_rows import write_rows

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig

WORKLOAD_ARGS = {
    "num_sessions": 16,
    "turns_per_session": 4,
    "system_prompt_len": 64,
    "first_message_len": 192,
    "user_message_len": 16,
    "answer_len": 16,
    "think_time_s": 5.0,
    "session_rate_rps": 1.0,
    "num_documents": 200,
    "document_len": 384,
    "document_output_len": 4,
    "document_rate_rps": 6.0,
}


def one_run(num_blocks: int, budget: float, seed: int, duration_s: float) -> dict[str, Any]:
    worker = WorkerConfig(
        worker_id="template",
        num_blocks=num_blocks,
        device="cpu",
        sessions=WarmSessionConfig(idle_ttl_s=60.0, budget_fraction=budget),
    )
    config = DeploymentConfig(coordinator=CoordinatorConfig(port=0), num_workers=2, worker=worker)
    deployment = Deployment(config)
    deployment.start()
    try:
        cmd = [
            sys.executable,
            "-m",
            "kvmesh.client.cli",
            "bench",
            "--address",
            deployment.address,
            "--workload",
            "chat_beside_batch",
            "--seed",
            str(seed),
            "--duration",
            str(duration_s),
            "--max-output-tokens",
            "16",
            "--json",
        ]
        for key, value in WORKLOAD_ARGS.items():
            cmd += ["--workload-arg", f"{key}={value}"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        doc = json.loads(out.stdout)
        metrics = next(iter(doc["policies"].values()))
        infos = deployment.cluster.infos() if deployment.cluster is not None else {}
        counters = [i.counters for i in infos.values()]
        return {
            "num_blocks": num_blocks,
            "budget": budget,
            "seed": seed,
            "reuse": metrics["hit_rate"] + metrics["pulled_rate"],
            "ttft_p50_ms": metrics["ttft_p50_ms"],
            "ttft_p90_ms": metrics["ttft_p90_ms"],
            "num_requests": metrics["num_requests"],
            "num_failed": metrics["num_failed"],
            "warm_sessions_evicted_ttl": sum(c.num_sessions_evicted_ttl for c in counters),
            "warm_sessions_evicted_budget": sum(c.num_sessions_evicted_budget for c in counters),
            "warm_sessions_evicted_pressure": sum(
                c.num_sessions_evicted_pressure for c in counters
            ),
        }
    finally:
        deployment.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-blocks", default="192,320", help="blocks of 16 tokens per worker")
    p.add_argument("--budget", type=float, default=0.5, help="warm share when on")
    p.add_argument("--seeds", default="0")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    start_local_ray(num_cpus=4)
    rows = []
    for num_blocks in (int(n) for n in args.num_blocks.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for budget in (0.0, args.budget):
                row = one_run(num_blocks, budget, seed, args.duration)
                rows.append(row)
                print(
                    f"blocks {num_blocks:4d} seed {seed} warm {'on ' if budget else 'off'}"
                    f" reuse {row['reuse']:.1%}  TTFT p50 {row['ttft_p50_ms']:.1f}"
                    f" p90 {row['ttft_p90_ms']:.1f} ms  failed {row['num_failed']}"
                    f"  evicted ttl/budget/pressure {row['warm_sessions_evicted_ttl']}/"
                    f"{row['warm_sessions_evicted_budget']}/{row['warm_sessions_evicted_pressure']}",
                    flush=True,
                )
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
