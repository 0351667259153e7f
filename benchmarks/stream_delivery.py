"""Tokens through the whole service: what a client sees between tokens with many streams open.

Usage: python benchmarks/stream_delivery.py [--streams 16] [--tokens 256] [--rounds 3] [--json F]

One `tiny-random` CPU worker behind one coordinator (a local deployment: Redis, Ray, gRPC), and
`--streams` clients each generating `--tokens` tokens (greedy, no early stop) at once, on threads
of a process of their own (as real clients are). Printed per round: the median time per output
token at the client ((last - first) / (tokens - 1)), the mean tokens per streamed message, the
tokens per second of all streams together, and the CPU time per token of the coordinator's
process and of the worker's. On a tiny model
an engine step is ~2 ms, so what this measures is the path each token takes: the worker actor's
stream, Ray, the coordinator, gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from local_ray import start_local_ray

from kvmesh.client import Client
from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.workers.config import WorkerConfig


def one_stream(address: str, num_tokens: int, seed: int, out: list[tuple[float, float]]) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(200) for _ in range(48)]
    first = last = 0.0
    num_messages = num_received = 0
    with Client(address) as client:
        for chunk in client.stream(prompt, max_tokens=num_tokens, ignore_eos=True):
            last = time.perf_counter()
            first = first or last
            num_messages += 1
            num_received += len(chunk.token_ids)
    out.append(((last - first) / max(1, num_received - 1), num_received / max(1, num_messages)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_clients(address: str, streams: int, tokens: int, seed: int) -> dict[str, float]:
    """One round: `streams` clients at once, each on its own thread (this process)."""
    per_stream: list[tuple[float, float]] = []
    threads = [
        threading.Thread(target=one_stream, args=(address, tokens, seed + i, per_stream))
        for i in range(streams)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {
        "streams": streams,
        "tpot_ms": 1e3 * statistics.median(s[0] for s in per_stream),
        "tokens_per_message": statistics.mean(s[1] for s in per_stream),
        "tokens_per_s": streams * tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:  # one round's clients, started by the run itself: "ready", then on "go"
        with Client(args.client) as client:
            client.wait_ready(60)
        print("ready", flush=True)
        sys.stdin.readline()
        print(
            json.dumps(run_clients(args.client, args.streams, args.tokens, args.seed)), flush=True
        )
        return
    start_local_ray(num_cpus=4)
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(port=0),
            num_workers=1,
            worker=WorkerConfig(worker_id="template", num_blocks=2048, device="cpu"),
        )
    )
    deployment.start()
    worker_pid = ray.get(deployment.cluster.actor("w0").info.remote()).pid
    rows = []
    try:
        for round_index in range(args.rounds):
            argv = [sys.executable, __file__, "--client", deployment.address]
            argv += ["--streams", str(args.streams), "--tokens", str(args.tokens)]
            argv += ["--seed", str(1000 * round_index)]
            clients = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            assert clients.stdin is not None and clients.stdout is not None
            clients.stdout.readline()  # "ready": imported and connected
            cpu_before = (cpu_seconds(os.getpid()), cpu_seconds(worker_pid))
            clients.stdin.write("go\n")
            clients.stdin.flush()
            row = json.loads(clients.stdout.readline())
            cpu_after = (cpu_seconds(os.getpid()), cpu_seconds(worker_pid))
            if clients.wait() != 0:
                raise RuntimeError(f"the clients failed (exit {clients.returncode})")
            num_tokens = args.streams * args.tokens
            row["coordinator_cpu_ms_per_token"] = (cpu_after[0] - cpu_before[0]) * 1e3 / num_tokens
            row["worker_cpu_ms_per_token"] = (cpu_after[1] - cpu_before[1]) * 1e3 / num_tokens
            rows.append(row)
            print(
                f"round {round_index}: {args.streams} streams, per token {row['tpot_ms']:.2f} ms,"
                f" {row['tokens_per_message']:.2f} tokens a message,"
                f" {row['tokens_per_s']:.0f} tokens/s; CPU per token: coordinator"
                f" {row['coordinator_cpu_ms_per_token']:.3f} ms, worker"
                f" {row['worker_cpu_ms_per_token']:.3f} ms",
                flush=True,
            )
    finally:
        deployment.stop()
        ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
