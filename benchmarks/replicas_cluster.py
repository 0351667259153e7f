"""Coordinator replicas on a real CPU cluster: one coordinator, then K, over one fleet.

    python benchmarks/replicas_cluster.py --seeds 0,1,2 --replicas 1,2,4 --decision-log
        [--speculative-dispatch off|on|both] [--processes] [--duration 30] --json FILE

Each run starts a fresh Redis, two `tiny-random` CPU workers as long-lived services (as
`kvmesh serve --workers 2` does) behind one coordinator and, for K > 1, K - 1 more coordinators
attached to them (`kvmesh serve --attach`); `kvmesh bench --address A,B --deal` replays one
shared-prefix workload, scaled to the CPU, with its requests dealt to the coordinators in turn.
Printed per run: reuse (hit and pulled shares of the prompt tokens, as the workers report them)
and TTFT (client side). Each replica hears the other's routes through the request notes; the
other coordinators' counts of the peer requests they replayed are printed too. With
`--decision-log`, the K > 1 coordinators commit every decision to the decision log in Redis and
apply each other's from it (one coordinator stays without it, the baseline); printed per
coordinator: decisions committed, lost commits retried, and the mean commit round trip. With
`--speculative-dispatch on`, those coordinators also send each request to its worker while its
commit travels (`both`: every K > 1 runs twice per seed, without then with, against the same
K=1 baseline); printed per coordinator: requests sent before their commit and redirects (lost
commits that moved a request to another worker). With `--processes`, each further coordinator
is its own `kvmesh serve --attach` process, as deployed (by default all share this process, and
so its GIL); their figures then come from `Stats`.

What it measures, per run: hit rate, pulled share, TTFT p50 / p90 (client side), requests and
failures; the goal compares each K's p90 TTFT and hit rate with the K=1 run of the same seed in
the same invocation (within 5 %).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
from local_ray import start_local_ray
from result_rows import write_rows

from kvmesh.client import Client
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


def deployment(
    redis_url: str, attach: bool, decision_log: bool, speculative: bool = False
) -> Deployment:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(
            port=0,
            redis_url=redis_url,
            decision_log=decision_log,
            speculative_dispatch=speculative,
        ),
        num_workers=2,
        worker=WorkerConfig(worker_id="template", num_blocks=256, device="cpu"),
        own_workers=False,
        attach=attach,
    )
    d = Deployment(config)
    d.start()
    return d


def serve_attached(
    redis_url: str, decision_log: bool, speculative: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """A second coordinator in its own process (`kvmesh serve --attach`), once it serves."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "kvmesh.client.cli", "serve", "--attach", "--port", str(port)]
    cmd += ["--ray-address", ray.get_runtime_context().gcs_address, "--redis-url", redis_url]
    cmd += ["--decision-log"] if decision_log else []
    cmd += ["--speculative-dispatch" if speculative else "--no-speculative-dispatch"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with Client(address, timeout_s=2) as client:
                if client.stats().num_live_workers >= 2:
                    return proc, address
        except Exception:  # not serving yet
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            tail = log.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"kvmesh serve --attach did not come up on {address}:\n{tail}")
        time.sleep(0.5)


def one_run(
    num_coordinators: int,
    seed: int,
    duration_s: float,
    log: bool,
    processes: bool,
    speculative: bool = False,
) -> dict[str, Any]:
    redis = start_redis_server()
    coordinators = [deployment(redis.url, attach=False, decision_log=log, speculative=speculative)]
    others: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for _ in range(num_coordinators - 1):
            if processes:
                others.append(serve_attached(redis.url, log, speculative))
            else:
                coordinators.append(
                    deployment(redis.url, attach=True, decision_log=log, speculative=speculative)
                )
        addresses = [d.address for d in coordinators] + [address for _, address in others]
        cmd = [sys.executable, "-m", "kvmesh.client.cli", "bench", "--address"]
        cmd += [",".join(addresses), "--deal", "--workload", "shared_prefix"]
        cmd += ["--seed", str(seed), "--duration", str(duration_s), "--json"]
        for key, value in WORKLOAD_ARGS.items():
            cmd += ["--workload-arg", f"{key}={value}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"bench failed: {out.stderr[-2000:]}")
        metrics = next(iter(json.loads(out.stdout)["policies"].values()))
        return {
            "coordinators": num_coordinators,
            "separate_processes": bool(others),
            "seed": seed,
            "hit_rate": metrics["hit_rate"],
            "pulled_rate": metrics["pulled_rate"],
            "ttft_p50_ms": metrics["ttft_p50_ms"],
            "ttft_p90_ms": metrics["ttft_p90_ms"],
            "num_requests": metrics["num_requests"],
            "num_failed": metrics["num_failed"],
            "peer_requests_replayed": [d.coordinator.peer_routes.num_taken for d in coordinators],
            "decision_log": log,
            "speculative_dispatch": speculative,
            "decisions": [_decisions(d) for d in coordinators]
            + [_served_decisions(address) for _, address in others],
        }
    finally:
        for proc, _ in others:
            proc.terminate()
            proc.wait(timeout=30)
        for d in reversed(coordinators):
            d.stop()
        for service in IndexStore(redis.url).services():  # service workers outlive coordinators
            try:
                ray.kill(ray.get_actor(service.actor_name, namespace=service.ray_namespace))
            except ValueError:
                pass
        redis.stop()
        _wait_for_free_resources()


def _wait_for_free_resources(timeout_s: float = 60.0) -> None:
    """Until Ray has taken back what the killed workers held (a kill is asynchronous: the next
    run's fleet would otherwise find the CPUs or GPU still taken)."""
    total = ray.cluster_resources()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(name, 0.0) >= total[name] for name in ("CPU", "GPU") if name in total):
            return
        time.sleep(0.5)


def _served_decisions(address: str) -> dict[str, float]:
    with Client(address, timeout_s=10) as client:
        s = client.stats()
    attempts = s.num_decision_commits + s.num_decision_lost_commits + s.num_decisions_unlogged
    return {
        "commits": s.num_decision_commits,
        "retries": s.num_decision_lost_commits,
        "forced": s.num_decision_forced_commits,
        "unlogged": s.num_decisions_unlogged,
        "commit_ms_mean": 1e3 * s.decision_commit_seconds / attempts if attempts else 0.0,
        "speculative_sends": s.num_speculative_sends,
        "redirects": s.num_decision_redirects,
    }


def _decisions(d: Deployment) -> dict[str, float]:
    c = d.coordinator.counters
    return {
        "commits": c.num_commits,
        "retries": c.num_commit_attempts - c.num_commits - c.num_unlogged,
        "forced": c.num_forced_commits,
        "unlogged": c.num_unlogged,
        "commit_ms_mean": 1e3 * c.commit_s / c.num_commit_attempts if c.num_commit_attempts else 0,
        "applied_seq": d.coordinator.decisions.cursor.applied_seq,
        "speculative_sends": c.num_speculative_sends,
        "redirects": c.num_redirects,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="0")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--json", metavar="FILE")
    p.add_argument(
        "--replicas", default="1,2", help="coordinator counts to run, e.g. 1,2,4 (1 = baseline)"
    )
    p.add_argument("--decision-log", action="store_true", help="K>1 replicas share the log")
    p.add_argument(
        "--speculative-dispatch",
        choices=("off", "on", "both"),
        default="off",
        help="with --decision-log: K>1 replicas send each request while its commit travels"
        " (both: run each K>1 without, then with)",
    )
    p.add_argument(
        "--processes", action="store_true", help="each further coordinator in its own process"
    )
    args = p.parse_args()
    if args.speculative_dispatch != "off" and not args.decision_log:
        p.error("--speculative-dispatch needs --decision-log")
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.speculative_dispatch]
    # A private local Ray on loopback; the --processes coordinator joins it with the same mode.
    start_local_ray(num_cpus=4)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        runs = [
            (k, spec)
            for k in (int(r) for r in args.replicas.split(","))
            for spec in (modes if k > 1 else (False,))
        ]
        for k, spec in runs:
            log = args.decision_log and k > 1
            row = one_run(k, seed, args.duration, log, args.processes, spec and log)
            rows.append(row)
            mode = " spec" if row["speculative_dispatch"] else ""
            print(
                f"K={k}{mode} seed {seed}: hit {row['hit_rate']:.1%}"
                f" pulled {row['pulled_rate']:.1%}"
                f"  TTFT p50 {row['ttft_p50_ms']:.1f} p90 {row['ttft_p90_ms']:.1f} ms"
                f"  requests {row['num_requests']} failed {row['num_failed']}"
                f"  peer requests replayed {row['peer_requests_replayed']}"
                f"  decisions {row['decisions'] if row['decision_log'] else '-'}",
                flush=True,
            )
            write_rows(args.json, rows)  # after every run: a later failure keeps these
    return 0


if __name__ == "__main__":
    sys.exit(main())
