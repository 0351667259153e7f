"""Micro-benchmarks of the hot paths, each beside its goal:

  * block hashing of an 8K-token prompt                       goal < 0.5 ms
  * router decision (match + price + pick), per worker count x 100K indexed blocks
                                                goal p99 < 0.3 ms at 64 workers, < 1 ms at 1,024
  * index event ingestion, worker -> Redis -> coordinator mirror               goal > 100K events/s
  * an 8K prompt across the coordinator -> worker seam (the handler's preparation of a request
    message, the request's frame to the worker, the worker's unframing and checks), its ids as
    one uint32 buffer (`TokenIds`) beside the same request carrying a tuple of ints

Usage: python benchmarks/micro.py [--workers 16,64,256,1024] [--reference] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from kvmesh.coordinator.cluster.redis_server import (
    RedisClusterServers,
    RedisServer,
    start_redis_cluster,
    start_redis_server,
)
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import IndexMirror, WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.coordinator.prompt_preparer import PromptPreparer
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.kvmesh_reference import KvmeshReferencePolicy
from kvmesh.coordinator.routing.policy import RouteQuery, WorkerColumns
from kvmesh.coordinator.service.request_messages import prepared_prompt
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto.block_hash import BlockHash, block_hash_array, block_hashes, namespace_hash
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.event_publisher import EventPublisher
from kvmesh.workers.engine.request_checks import check_request
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.request_channel import Frame, decode, encode

BS = 16
ROOT = namespace_hash("bench-model")


def percentiles(samples_ms: list[float], prefix: str = "") -> dict[str, float]:
    s = sorted(samples_ms)
    return {
        f"{prefix}p50_ms": s[len(s) // 2],
        f"{prefix}p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))],
        f"{prefix}mean_ms": statistics.fmean(s),
    }


def bench_hash(iterations: int = 300) -> dict[str, float]:
    """The chain of an 8K-token prompt, and its uint64 array, as a prepared prompt has both."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, 8192).tolist()
    block_hash_array(block_hashes(tokens, BS, ROOT))
    samples = []
    for _ in range(iterations):
        t = time.perf_counter()
        block_hash_array(block_hashes(tokens, BS, ROOT))
        samples.append((time.perf_counter() - t) * 1e3)
    return percentiles(samples)


def bench_seam(iterations: int = 300) -> dict[str, float]:
    """An 8K prompt from a request message to a checked worker request: the coordinator's leg
    (prepare, build, frame) and the worker's (unframe, check), as `TokenIds` and, as the
    baseline, with the prompt carried as a tuple of Python ints."""
    model = preset("llama3-8b-random")
    prompts = PromptPreparer(CoordinatorConfig(), model)
    message = pb.GenerateRequest()
    message.token_ids.extend(np.random.default_rng(1).integers(0, 128_000, 8192).tolist())
    sampling = SamplingConfig(max_tokens=1)

    def coordinator_leg(as_tuple: bool) -> bytes:
        prompt = prepared_prompt(prompts, 0, message)
        ids = tuple(prompt.token_ids) if as_tuple else prompt.token_ids
        return encode(Frame.SUBMIT, 1, WorkerRequest("r", ids, sampling))

    def worker_leg(frame: bytes) -> None:
        _kind, _seq, request = decode(frame[4:])
        check_request(request, model, ())

    out: dict[str, float] = {}
    for name, as_tuple in (("token_ids", False), ("tuple", True)):
        frame = coordinator_leg(as_tuple)
        coordinator, worker = [], []
        for _ in range(iterations):
            t = time.perf_counter()
            coordinator_leg(as_tuple)
            t1 = time.perf_counter()
            worker_leg(frame)
            worker.append((time.perf_counter() - t1) * 1e3)
            coordinator.append((t1 - t) * 1e3)
        out[f"{name}_coordinator_p50_ms"] = statistics.median(coordinator)
        out[f"{name}_worker_p50_ms"] = statistics.median(worker)
        out[f"{name}_frame_bytes"] = float(len(frame))
    return out


def _indexed_mirror(
    num_workers: int, num_blocks: int, rng: random.Random
) -> tuple[IndexMirror, list[list[BlockHash]]]:
    """200 prompt families of 512 blocks (8K tokens); each worker holds prefixes of some."""
    mirror = IndexMirror()
    families = [
        block_hashes(list(range(f * 10_000, f * 10_000 + 8192)), BS, ROOT) for f in range(200)
    ]
    for w in range(num_workers):
        mirror.load_worker(WorkerId(f"w{w}"), 1, 0, [])
    seq = dict.fromkeys(range(num_workers), 0)
    while mirror.num_blocks < num_blocks:
        w, fam = rng.randrange(num_workers), rng.choice(families)
        depth = rng.randrange(1, len(fam))
        seq[w] += 1
        mirror.apply(EventBatch(f"w{w}", 1, seq[w], (BlockStored(tuple(fam[:depth])),)))
    return mirror, families


def bench_router(
    num_workers: int = 16,
    num_blocks: int = 100_000,
    iterations: int = 2000,
    policy_type: type[KvmeshPolicy] = KvmeshPolicy,
) -> dict[str, float]:
    """One decision = what `FleetView.columns` + `route` do: the mirror's match, the workers'
    columns (load, capacity, match), kvmesh's policy pricing all of them and picking one. Each
    prompt's hashes come with their uint64 array, made where they are hashed, as the prompt
    preparer makes it (timed in `bench_hash`), to the mirror and in the query, as
    `Coordinator.route` passes them.
    Timed twice: wall clock (`p50_ms`, ...) and this thread's CPU time (`cpu_p50_ms`, ...):
    on a shared machine the wall clock's tail is other processes' time slices."""
    rng = random.Random(0)
    np_rng = np.random.default_rng(0)
    mirror, families = _indexed_mirror(num_workers, num_blocks, rng)
    arrays = [block_hash_array(f) for f in families]
    policy = policy_type(CostModel(), random.Random(1))
    workers = tuple(WorkerId(f"w{w}") for w in range(num_workers))
    index_of = {w: i for i, w in enumerate(workers)}
    capacity = np.full(num_workers, 10_000, dtype=np.int64)
    # every fourth pool is full: its queue and the 512-block prompt wait for blocks there
    free = np.where(np.arange(num_workers) % 4 == 0, 100, 5_000).astype(np.int64)
    queued_tokens = np.full(num_workers, 100, dtype=np.int64)
    running = np.full(num_workers, 3, dtype=np.int64)
    samples, cpu_samples = [], []
    for i in range(iterations):
        hashes = families[i % len(families)]
        queued_ms = np_rng.random(num_workers) * 50
        cpu = time.thread_time()
        t = time.perf_counter()
        matched, device, _ = mirror.match_fleet(
            hashes, index_of, num_workers, arrays[i % len(families)]
        )
        cols = WorkerColumns(
            workers, capacity, free, queued_ms, queued_tokens, running, matched, device, index_of
        )
        views = cols if policy_type is KvmeshPolicy else list(cols)
        query = RouteQuery(str(i), hashes, 8192, BS, block_hash_array=arrays[i % len(families)])
        policy.choose(query, views)
        samples.append((time.perf_counter() - t) * 1e3)
        cpu_samples.append((time.thread_time() - cpu) * 1e3)
    out = percentiles(samples) | percentiles(cpu_samples, "cpu_")
    out["num_workers"] = num_workers
    out["indexed_blocks"] = mirror.num_blocks
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_mirror(
    num_blocks: int = 10_000_000, num_workers: int = 64, batch_blocks: int = 4096
) -> dict[str, float]:
    """Resident memory per indexed block, and the match cost, with `num_blocks` blocks in the
    mirror: workers store 4K-block runs of random hashes (an eighth of them also stored by a
    second worker), then 200 indexed 512-block chains are matched."""
    np_rng = np.random.default_rng(0)
    mirror = IndexMirror()
    workers = [WorkerId(f"w{w}") for w in range(num_workers)]
    for w in workers:
        mirror.load_worker(w, 1, 0, [])
    gc.collect()
    before = _rss_bytes()
    seq = dict.fromkeys(workers, 0)
    chains: list[list[BlockHash]] = []
    started = time.perf_counter()
    while mirror.num_blocks < num_blocks:
        hashes = np_rng.integers(1, 2**63, batch_blocks, dtype=np.uint64).tolist()
        owners = [workers[int(np_rng.integers(num_workers))]]
        if np_rng.random() < 0.125:
            owners.append(workers[int(np_rng.integers(num_workers))])
        for w in owners:
            seq[w] += 1
            mirror.apply(EventBatch(w, 1, seq[w], (BlockStored(tuple(hashes)),)))
        if len(chains) < 200:
            chains.append(hashes[:512])
    ingest_s = time.perf_counter() - started
    gc.collect()
    rss = _rss_bytes() - before
    # What the process holds once the allocator hands its free pages back (merges leave big
    # freed temporaries in the C heap): the mirror's own footprint.
    ctypes.CDLL(None).malloc_trim(0)
    rss_trimmed = _rss_bytes() - before
    samples = []
    for i in range(2000):
        t = time.perf_counter()
        mirror.match(chains[i % len(chains)])
        samples.append((time.perf_counter() - t) * 1e3)
    out = percentiles(samples)
    out.update(
        num_blocks=mirror.num_blocks,
        num_workers=num_workers,
        rss_bytes=rss,
        bytes_per_block=rss / mirror.num_blocks,
        bytes_per_block_trimmed=rss_trimmed / mirror.num_blocks,
        apply_block_events_per_s=mirror.num_events_applied / ingest_s,
    )
    return out


def _publish_share(
    url: str,
    ns: str,
    worker: int,
    num_batches: int,
    batch_blocks: int,
    linked: bool,
    go: Any,
    ready: Any,
    cpu_s: Any,
) -> None:
    """One worker's batches: each a 256-block chain that continues the one before, with its
    parent and depth as a worker sends them (`linked`), or without (as this benchmark sent
    them before the links moved into the worker's blocks HASH)."""
    publisher = EventPublisher(url, ns, f"w{worker}")
    base = worker * num_batches * batch_blocks
    batches = []
    for b in range(num_batches):
        first = base + b * batch_blocks + 1
        hashes = tuple(BlockHash(first + i) for i in range(batch_blocks))
        parent, depth = (BlockHash(first - 1 if b else ROOT), b * batch_blocks + 1)
        stored = BlockStored(hashes, 0, parent, depth) if linked else BlockStored(hashes)
        batches.append(EventBatch(f"w{worker}", 1, b + 1, (stored,)))
    ready.release()
    go.wait()
    started = time.process_time()
    for batch in batches:
        publisher.publish(batch)
    cpu_s.put(time.process_time() - started)


def _redis_cpu_s(server: RedisServer | RedisClusterServers) -> float:
    """CPU seconds the Redis server(s) used so far (every thread, user + system)."""
    servers = server.servers if isinstance(server, RedisClusterServers) else [server]
    total = 0.0
    for one in servers:
        client = redis.Redis.from_url(one.url)
        cpu = client.info("cpu")
        client.close()
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


def bench_ingest(
    num_workers: int = 2,
    num_batches: int = 300,
    batch_blocks: int = 256,
    cluster: int = 0,
    linked: bool = True,
) -> dict[str, float]:
    """Workers publish from their own processes (as Ray workers do); this process follows.
    `cluster`: that many masters of a local Redis Cluster (0: one plain Redis). `linked`:
    stored events carry their parent and depth (the radix links), as a worker's do."""
    server: RedisServer | RedisClusterServers = (
        start_redis_cluster(cluster) if cluster else start_redis_server()
    )
    try:
        ns = "bench"
        follower = IndexFollower(IndexStore(server.url), LockedMirror(), ns=ns)
        follower.rebuild()
        total_events = num_workers * num_batches * batch_blocks
        ctx = multiprocessing.get_context("spawn")
        go, ready, cpu_s = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
        procs = [
            ctx.Process(
                target=_publish_share,
                args=(server.url, ns, w, num_batches, batch_blocks, linked, go, ready, cpu_s),
            )
            for w in range(num_workers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()  # processes started and batches built: time only the publishing
        redis_cpu_before = _redis_cpu_s(server)
        t0, follower_t0 = time.perf_counter(), time.thread_time()
        go.set()
        while follower.mirror.num_blocks < total_events:
            follower.poll_once(block_ms=50)
        t_total = time.perf_counter() - t0
        follower_cpu_s = time.thread_time() - follower_t0
        publisher_cpu_s = sum(cpu_s.get() for _ in procs)
        for p in procs:
            p.join()
        redis_cpu_s = _redis_cpu_s(server) - redis_cpu_before
        # CPU microseconds per block event, per stage: what the pipeline costs on cores of its
        # own, whatever else runs on the machine (the end-to-end rate shares it).
        per_block_us = {
            "redis_us_per_block": redis_cpu_s / total_events * 1e6,
            "publisher_us_per_block": publisher_cpu_s / total_events * 1e6,
            "follower_us_per_block": follower_cpu_s / total_events * 1e6,
        }
        return {
            "events": total_events,
            "publishers": num_workers,
            "cluster_masters": cluster,
            "linked": linked,
            "end_to_end_events_per_s": total_events / t_total,
            **per_block_us,
            "cpu_us_per_block": sum(per_block_us.values()),
            "mirror_blocks": follower.mirror.num_blocks,
        }
    finally:
        server.stop()


def _cpu_split(ingest: dict[str, float]) -> str:
    """CPU us per block: Redis + publishers + follower."""
    return (
        f"CPU us/block {ingest['redis_us_per_block']:.2f} + {ingest['publisher_us_per_block']:.2f}"
        f" + {ingest['follower_us_per_block']:.2f}"
    )


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--workers",
        default="16,64,256,1024",
        help="comma-separated worker counts for the router benchmark (default: %(default)s)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also time the scalar reference policy (slow at 1,024 workers)",
    )
    parser.add_argument("--skip-ingest", action="store_true", help="skip the Redis ingestion run")
    parser.add_argument(
        "--mirror-blocks",
        type=lambda x: [int(float(v)) for v in x.split(",")],
        default=[],
        metavar="N,...",
        help="also measure the mirror's memory and match cost at these block counts (1e5,1e7)",
    )
    parser.add_argument(
        "--ingest-unlinked",
        action="store_true",
        help="publish stored events without parent and depth (the benchmark before 2026-11-26)",
    )
    parser.add_argument(
        "--cluster-ingest",
        default="",
        metavar="MASTERS,PUBLISHERS",
        help="also time ingestion into a local Redis Cluster (e.g. 3,4)",
    )
    args = parser.parse_args()
    worker_counts = [int(x) for x in args.workers.split(",") if x]
    results = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
        },
        "hash_8k": bench_hash(),
        "seam_8k": bench_seam(),
        "router": [bench_router(n) for n in worker_counts],
    }
    if args.reference:
        results["router_reference"] = [
            bench_router(n, iterations=max(50, 20_000 // n), policy_type=KvmeshReferencePolicy)
            for n in worker_counts
        ]
    h = results["hash_8k"]
    rows = [
        (
            "block hash, 8K tokens",
            f"p50 {h['p50_ms']:.3f} ms  p99 {h['p99_ms']:.3f} ms",
            "< 0.5 ms",
        ),
    ]
    m = results["seam_8k"]
    ways = (("token_ids", "one uint32 buffer"), ("tuple", "a tuple of ints (baseline)"))
    for name, label in ways:
        rows.append(
            (
                f"8K prompt across the seam, {label}: coordinator; worker",
                f"p50 {m[f'{name}_coordinator_p50_ms']:.3f} ms; {m[f'{name}_worker_p50_ms']:.3f} ms"
                f"  ({m[f'{name}_frame_bytes'] / 1024:.0f} KiB frame)",
                "-",
            )
        )
    for key, label in (("router", ""), ("router_reference", " (scalar reference)")):
        for r in results.get(key, []):
            n = int(r["num_workers"])
            rows.append(
                (
                    f"router decision{label}, {n} workers, 100K blocks (wall; CPU)",
                    f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms;"
                    f" {r['cpu_p50_ms']:.3f} / {r['cpu_p99_ms']:.3f}",
                    "p99 < 0.3 ms" if n <= 64 else "p99 < 1 ms",
                )
            )
    if not args.skip_ingest:
        g = results["ingest"] = bench_ingest(linked=not args.ingest_unlinked)
        rows.append(
            (
                f"event ingestion, {g['publishers']} workers -> Redis -> mirror",
                f"{g['end_to_end_events_per_s']:,.0f} block events/s; {_cpu_split(g)}",
                "> 100K/s",
            )
        )
    if args.cluster_ingest:
        masters, publishers = (int(x) for x in args.cluster_ingest.split(","))
        c = results["cluster_ingest"] = bench_ingest(
            publishers, cluster=masters, linked=not args.ingest_unlinked
        )
        rows.append(
            (
                f"event ingestion, {publishers} workers -> {masters}-master cluster -> mirror",
                f"{c['end_to_end_events_per_s']:,.0f} block events/s; {_cpu_split(c)}",
                ">= 500K/s",
            )
        )
    if args.mirror_blocks:
        results["mirror"] = [bench_mirror(n) for n in args.mirror_blocks]
        for m in results["mirror"]:
            rows.append(
                (
                    f"mirror, {m['num_blocks']:,.0f} blocks: RSS/block (trimmed), match p50/p99",
                    f"{m['bytes_per_block']:.0f} ({m['bytes_per_block_trimmed']:.0f}) B"
                    f"  {m['p50_ms']:.3f} / {m['p99_ms']:.3f} ms",
                    "<= 100 B, flat",
                )
            )
    width = max(len(a) for a, _, _ in rows)
    print(f"{'benchmark':<{width}}  {'measured':<64}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:<64}  {goal}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
