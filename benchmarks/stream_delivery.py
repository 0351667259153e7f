"""Tokens through the whole service: what a client sees between tokens with many streams open.

Usage: python benchmarks/stream_delivery.py [--streams 16] [--tokens 256] [--rounds 3] [--json F]

One `tiny-random` CPU worker behind one coordinator (a local deployment: Redis, Ray, gRPC), and
`--streams` clients each generating `--tokens` tokens (greedy, no early stop) at once. Printed per
round: the median time per output token at the client ((last - first) / (tokens - 1)), the mean
tokens per streamed message, and the tokens per second of all streams together. On a tiny model
an engine step is ~2 ms, so what this measures is the path each token takes: the worker actor's
stream, Ray, the coordinator, gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import ray

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(port=0),
            num_workers=1,
            worker=WorkerConfig(worker_id="template", num_blocks=2048, device="cpu"),
        )
    )
    deployment.start()
    rows = []
    try:
        for round_index in range(args.rounds):
            per_stream: list[tuple[float, float]] = []
            threads = [
                threading.Thread(
                    target=one_stream,
                    args=(deployment.address, args.tokens, 1000 * round_index + i, per_stream),
                )
                for i in range(args.streams)
            ]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            row = {
                "streams": args.streams,
                "tpot_ms": 1e3 * statistics.median(s[0] for s in per_stream),
                "tokens_per_message": statistics.mean(s[1] for s in per_stream),
                "tokens_per_s": args.streams * args.tokens / elapsed,
            }
            rows.append(row)
            print(
                f"round {round_index}: {args.streams} streams, per token {row['tpot_ms']:.2f} ms,"
                f" {row['tokens_per_message']:.2f} tokens a message,"
                f" {row['tokens_per_s']:.0f} tokens/s",
                flush=True,
            )
    finally:
        deployment.stop()
        ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
