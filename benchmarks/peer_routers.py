"""kvmesh's router side by side with the real peer routers, in front of the same kvmesh workers.

Usage: python benchmarks/peer_routers.py [--rates 2 4 8] [--duration 20] [--trace PATH]
       (needs `pip install -e '.[peers]'`: sglang-router 0.3.2, vllm-router 0.1.17)

One local deployment (tiny-random CPU workers, real Redis and Ray) serves the OpenAI API. Each
run sends one workload at one Poisson rate with `kvmesh bench --http`'s client to one of:

    kvmesh          the coordinator's own /v1 (kvmesh's router)
    sglang-router   `sglang-router launch --policy cache_aware` (its defaults) over the
                    per-worker endpoints /workers/{id}
    vllm-router     `vllm-router --policy cache_aware` over the same endpoints

Before every run the workers' caches are cleared (admin ClearCache) and the peer router is started
afresh, so no run inherits another's cache or radix tree; the order of the routers rotates with
the rate. Workloads are scaled to the tiny model's 2048-token context: shared_prefix, multi_turn,
and the first requests of the conversation trace with each of its 512-token hash blocks shrunk to
16 tokens. Writes JSON (--out), a chart (--plot) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx

from kvmesh.client import http_bench
from kvmesh.client.bench import send_times, summarize
from kvmesh.client.trace_replay import expand_tokens, read_trace
from kvmesh.client.workloads import WorkloadRequest, generate
from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers.config import WorkerConfig

ROUTERS = ("kvmesh", "sglang-router", "vllm-router")
STYLES = {"kvmesh": ("o", "-"), "sglang-router": ("s", "--"), "vllm-router": ("^", ":")}
SMALL = {
    "shared_prefix": {
        "num_groups": 8,
        "users_per_group": 32,
        "system_prompt_len": 512,
        "question_len": 32,
        "vocab_size": 256,
    },
    "multi_turn": {
        "num_sessions": 64,
        "turns_per_session": 4,
        "system_prompt_len": 128,
        "first_message_len": 256,
        "user_message_len": 32,
        "answer_len": 32,
        "think_time_s": 2.0,
        "vocab_size": 256,
    },
}
TRACE = "../shared/traces/conversation_trace.jsonl"


def workload(name: str, trace: str, max_requests: int) -> list[WorkloadRequest]:
    if name != "conversation_trace":
        return generate(name, 0, SMALL[name])[:max_requests]
    out = []
    for i, record in enumerate(read_trace(trace, 512)):
        if i >= max_requests:
            break
        length = min(1500, max(1, math.ceil(record.input_length * 16 / 512)))
        tokens = expand_tokens(record.hash_ids, length, 16, 256)
        out.append(WorkloadRequest(record.timestamp_ms, tokens, max(1, record.output_length)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_router(name: str, workers: list[str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    binary = shutil.which(name) or str(Path(sys.executable).parent / name)
    common = ["--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1"]
    cmd = [binary, "launch", *common] if name == "sglang-router" else [binary, *common]
    log = open(log_dir / f"{name}.log", "a")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{name} did not come up (see {log_dir}/{name}.log)")


def stop_router(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def runs(args: argparse.Namespace) -> Iterator[tuple[str, float, list[str]]]:
    for name in args.workloads:
        for i, rate in enumerate(args.rates):
            order = list(
                args.routers[i % len(args.routers) :] + args.routers[: i % len(args.routers)]
            )
            yield name, rate, order


def one_run(
    deployment: Deployment,
    stub: pb_grpc.KVMeshStub,
    router: str,
    schedule: list,
    args: argparse.Namespace,
) -> dict:
    stub.ClearCache(pb.ClearCacheRequest(), timeout=60)
    time.sleep(1.0)  # let the cleared events reach the index
    proc = None
    url = deployment.http_url
    if router != "kvmesh":
        workers = [f"{deployment.http_url}/workers/w{i}" for i in range(args.workers)]
        proc, url = start_router(router, workers, args.log_dir)
    try:
        samples, _model, elapsed = asyncio.run(
            http_bench.drive(
                url, schedule, concurrency=64, timeout_s=300, max_output=args.max_output_tokens
            )
        )
    finally:
        if proc is not None:
            stop_router(proc)
    metrics = summarize(samples, [f"w{i}" for i in range(args.workers)], elapsed)
    metrics["errors"] = sorted({s.error for s in samples if s.error})[:5]
    return metrics


def table(results: dict) -> str:
    lines = []
    for name, by_rate in results.items():
        lines += [
            f"\n**{name}**\n",
            "| rate req/s | router | local hit % | pulled % | TTFT p50 ms | p90 ms | p99 ms"
            " | req/s | failed |",
            "|--:|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for rate, by_router in by_rate.items():
            for router, m in by_router.items():
                label = f"**{router}**" if router == "kvmesh" else router
                lines.append(
                    f"| {rate} | {label} | {100 * m['hit_rate']:.1f}"
                    f" | {100 * m['pulled_rate']:.1f} | {m['ttft_p50_ms']:.0f}"
                    f" | {m['ttft_p90_ms']:.0f} | {m['ttft_p99_ms']:.0f}"
                    f" | {m['throughput_rps']:.2f} | {m['num_failed']} |"
                )
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(4.5 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        by_rate = results[name]
        rates = [float(r) for r in by_rate]
        for router in ROUTERS:
            if not all(router in by_rate[r] for r in by_rate):
                continue
            p90 = [by_rate[r][router]["ttft_p90_ms"] for r in by_rate]
            hit = [
                100 * (by_rate[r][router]["hit_rate"] + by_rate[r][router]["pulled_rate"])
                for r in by_rate
            ]
            marker, line = STYLES[router]
            axes[0][col].plot(rates, p90, marker=marker, linestyle=line, label=router)
            axes[1][col].plot(rates, hit, marker=marker, linestyle=line, label=router)
        axes[0][col].set_title(name)
        axes[0][col].set_ylabel("TTFT p90 (ms)")
        axes[1][col].set_ylabel("reused prompt tokens, local + pulled (%)")
        axes[1][col].set_xlabel("offered rate (req/s)")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--max-output-tokens", type=int, default=8)
    p.add_argument(
        "--workloads", nargs="+", default=["shared_prefix", "multi_turn", "conversation_trace"]
    )
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--out", default="bench-results/peer_routers.json")
    p.add_argument("--plot", default="docs/img/peer-routers.png")
    p.add_argument("--log-dir", type=Path, default=Path("bench-results/peer-router-logs"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(port=0),
            num_workers=args.workers,
            worker=WorkerConfig(worker_id="template", num_blocks=args.num_blocks, device="cpu"),
            http=HttpConfig(port=0),
        )
    )
    deployment.start()
    results: dict = {}
    try:
        stub = pb_grpc.KVMeshStub(grpc.insecure_channel(deployment.address))
        for name, rate, order in runs(args):
            requests = workload(name, args.trace, args.max_requests)
            schedule = send_times(requests, rate, args.duration, 0)
            for router in order:
                print(f"# {name} at {rate} req/s through {router}", file=sys.stderr, flush=True)
                metrics = one_run(deployment, stub, router, schedule, args)
                results.setdefault(name, {}).setdefault(str(rate), {})[router] = metrics
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=2))
    finally:
        deployment.stop()
    for by_rate in results.values():  # the routers in one fixed order in the table
        for rate in by_rate:
            by_rate[rate] = {r: by_rate[rate][r] for r in ROUTERS if r in by_rate[rate]}
    Path(args.out).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
