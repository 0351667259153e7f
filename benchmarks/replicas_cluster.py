"""Coordinator replicas on a real CPU cluster: one coordinator, then two, over one fleet.

    python benchmarks/replicas_cluster.py --seeds 0 --json bench-results/replicas_cluster.json

Each run starts a fresh Redis, two `tiny-random` CPU workers as long-lived services (as
`kvmesh serve --workers 2` does) behind one coordinator and, for K=2, a second coordinator
attached to them (`kvmesh serve --attach`); `kvmesh bench --address A,B --deal` replays one
shared-prefix workload, scaled to the CPU, with its requests dealt to the coordinators in turn.
Printed per run: reuse (hit and pulled shares of the prompt tokens, as the workers report them)
and TTFT (client side). Each replica hears the other's routes through the request notes; the
second coordinator's count of the peer requests it replayed is printed too. With
`--decision-log`, the K=2 coordinators commit every decision to the decision log in Redis and
apply each other's from it (one coordinator stays without it, the baseline); printed per
coordinator: decisions committed, lost commits retried, and the mean commit round trip.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.workers.config import WorkerConfig

WORKLOAD_ARGS = {
    "num_groups": 6,
    "users_per_group": 40,
    "system_prompt_len": 256,
    "question_len": 32,
    "output_len": 8,
    "rate_rps": 8.0,
    "vocab_size": 256,
}


def deployment(redis_url: str, attach: bool, decision_log: bool) -> Deployment:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0, redis_url=redis_url, decision_log=decision_log),
        num_workers=2,
        worker=WorkerConfig(worker_id="template", num_blocks=256, device="cpu"),
        own_workers=False,
        attach=attach,
    )
    d = Deployment(config)
    d.start()
    return d


def one_run(num_coordinators: int, seed: int, duration_s: float, log: bool) -> dict[str, Any]:
    redis = start_redis_server()
    coordinators = [deployment(redis.url, attach=False, decision_log=log)]
    try:
        coordinators += [
            deployment(redis.url, attach=True, decision_log=log)
            for _ in range(num_coordinators - 1)
        ]
        cmd = [sys.executable, "-m", "kvmesh.client.cli", "bench", "--address"]
        cmd += [",".join(d.address for d in coordinators), "--deal", "--workload", "shared_prefix"]
        cmd += ["--seed", str(seed), "--duration", str(duration_s), "--json"]
        for key, value in WORKLOAD_ARGS.items():
            cmd += ["--workload-arg", f"{key}={value}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"bench failed: {out.stderr[-2000:]}")
        metrics = next(iter(json.loads(out.stdout)["policies"].values()))
        return {
            "coordinators": num_coordinators,
            "seed": seed,
            "hit_rate": metrics["hit_rate"],
            "pulled_rate": metrics["pulled_rate"],
            "ttft_p50_ms": metrics["ttft_p50_ms"],
            "ttft_p90_ms": metrics["ttft_p90_ms"],
            "num_requests": metrics["num_requests"],
            "num_failed": metrics["num_failed"],
            "peer_requests_replayed": [d.coordinator.peer_routes.num_taken for d in coordinators],
            "decision_log": log,
            "decisions": [_decisions(d) for d in coordinators],
        }
    finally:
        for d in reversed(coordinators):
            d.stop()
        for service in IndexStore(redis.url).services():  # service workers outlive coordinators
            try:
                ray.kill(ray.get_actor(service.actor_name, namespace=service.ray_namespace))
            except ValueError:
                pass
        redis.stop()


def _decisions(d: Deployment) -> dict[str, float]:
    c = d.coordinator.counters
    return {
        "commits": c.num_commits,
        "retries": c.num_commit_attempts - c.num_commits - c.num_unlogged,
        "forced": c.num_forced_commits,
        "unlogged": c.num_unlogged,
        "commit_ms_mean": 1e3 * c.commit_s / c.num_commit_attempts if c.num_commit_attempts else 0,
        "applied_seq": d.coordinator.log_cursor.applied_seq,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", default="0")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--decision-log", action="store_true", help="K=2 replicas share the log")
    args = p.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for k in (1, 2):
            row = one_run(k, seed, args.duration, args.decision_log and k > 1)
            rows.append(row)
            print(
                f"K={k} seed {seed}: hit {row['hit_rate']:.1%} pulled {row['pulled_rate']:.1%}"
                f"  TTFT p50 {row['ttft_p50_ms']:.1f} p90 {row['ttft_p90_ms']:.1f} ms"
                f"  requests {row['num_requests']} failed {row['num_failed']}"
                f"  peer requests replayed {row['peer_requests_replayed']}"
                f"  decisions {row['decisions'] if row['decision_log'] else '-'}",
                flush=True,
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
