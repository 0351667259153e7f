"""Micro-benchmarks of the hot paths, each beside its goal:

  * block hashing of an 8K-token prompt                       goal < 0.5 ms
  * router decision (match + price + pick), 16 workers x 100K indexed blocks   goal p99 < 1 ms
  * index event ingestion, worker -> Redis -> coordinator mirror               goal > 100K events/s

Usage: python benchmarks/micro.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import IndexMirror, WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.router import KvmeshPolicy, RouteQuery, WorkerView
from kvmesh.proto.block_hash import BlockHash, block_hashes, namespace_hash
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.engine.event_publisher import EventPublisher

BS = 16
ROOT = namespace_hash("bench-model")


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    s = sorted(samples_ms)
    return {
        "p50_ms": s[len(s) // 2],
        "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))],
        "mean_ms": statistics.fmean(s),
    }


def bench_hash(iterations: int = 300) -> dict[str, float]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, 8192).tolist()
    block_hashes(tokens, BS, ROOT)
    samples = []
    for _ in range(iterations):
        t = time.perf_counter()
        block_hashes(tokens, BS, ROOT)
        samples.append((time.perf_counter() - t) * 1e3)
    return percentiles(samples)


def bench_router(
    num_workers: int = 16, num_blocks: int = 100_000, iterations: int = 2000
) -> dict[str, float]:
    rng = random.Random(0)
    mirror = IndexMirror()
    # 200 prompt families of 512 blocks (8K tokens); each worker holds prefixes of some of them.
    families = [
        block_hashes(list(range(f * 10_000, f * 10_000 + 8192)), BS, ROOT) for f in range(200)
    ]
    indexed = 0
    for w in range(num_workers):
        mirror.load_worker(WorkerId(f"w{w}"), 1, 0, [])
    seq = {w: 0 for w in range(num_workers)}
    while indexed < num_blocks:
        w, fam = rng.randrange(num_workers), rng.choice(families)
        depth = rng.randrange(1, len(fam))
        seq[w] += 1
        mirror.apply(EventBatch(f"w{w}", 1, seq[w], (BlockStored(tuple(fam[:depth])),)))
        indexed = mirror.num_blocks
    policy = KvmeshPolicy(CostModel(), random.Random(1))
    workers = [WorkerId(f"w{w}") for w in range(num_workers)]
    samples = []
    for i in range(iterations):
        hashes = families[i % len(families)]
        t = time.perf_counter()
        matches = mirror.match(hashes)
        views = []
        for w in workers:
            m = matches.get(w)
            n = m.num_blocks if m else 0
            views.append(WorkerView(w, 10_000, 5_000, rng.random() * 50, 100, 3, n, n))
        policy.choose(RouteQuery(str(i), hashes, 8192, BS), views)
        samples.append((time.perf_counter() - t) * 1e3)
    out = percentiles(samples)
    out["indexed_blocks"] = mirror.num_blocks
    return out


def _publish_share(
    url: str, ns: str, worker: int, num_batches: int, batch_blocks: int, go: Any, ready: Any
) -> None:
    publisher = EventPublisher(url, ns, f"w{worker}")
    base = worker * num_batches * batch_blocks
    batches = [
        EventBatch(
            f"w{worker}",
            1,
            b + 1,
            (
                BlockStored(
                    tuple(BlockHash(base + b * batch_blocks + i + 1) for i in range(batch_blocks))
                ),
            ),
        )
        for b in range(num_batches)
    ]
    ready.release()
    go.wait()
    for batch in batches:
        publisher.publish(batch)


def bench_ingest(
    num_workers: int = 2, num_batches: int = 300, batch_blocks: int = 256
) -> dict[str, float]:
    """Workers publish from their own processes (as Ray workers do); this process follows."""
    server = start_redis_server()
    try:
        ns = "bench"
        follower = IndexFollower(IndexStore(server.url), LockedMirror(), ns=ns)
        follower.rebuild()
        total_events = num_workers * num_batches * batch_blocks
        ctx = multiprocessing.get_context("spawn")
        go, ready = ctx.Event(), ctx.Semaphore(0)
        procs = [
            ctx.Process(
                target=_publish_share,
                args=(server.url, ns, w, num_batches, batch_blocks, go, ready),
            )
            for w in range(num_workers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()  # processes started and batches built: time only the publishing
        t0 = time.perf_counter()
        go.set()
        while follower.mirror.num_blocks < total_events:
            follower.poll_once(block_ms=50)
        t_total = time.perf_counter() - t0
        for p in procs:
            p.join()
        return {
            "events": total_events,
            "publishers": num_workers,
            "end_to_end_events_per_s": total_events / t_total,
            "mirror_blocks": follower.mirror.num_blocks,
        }
    finally:
        server.stop()


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
        },
        "hash_8k": bench_hash(),
        "router_16w_100k": bench_router(),
        "ingest": bench_ingest(),
    }
    h, r, g = results["hash_8k"], results["router_16w_100k"], results["ingest"]
    rows = [
        (
            "block hash, 8K tokens",
            f"p50 {h['p50_ms']:.3f} ms  p99 {h['p99_ms']:.3f} ms",
            "< 0.5 ms",
        ),
        (
            "router decision, 16 workers, 100K blocks",
            f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms",
            "p99 < 1 ms",
        ),
        (
            f"event ingestion, {g['publishers']} workers -> Redis -> mirror",
            f"{g['end_to_end_events_per_s']:,.0f} block events/s",
            "> 100K/s",
        ),
    ]
    width = max(len(a) for a, _, _ in rows)
    print(f"{'benchmark':<{width}}  {'measured':<34}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:<34}  {goal}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
