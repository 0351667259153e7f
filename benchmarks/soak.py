"""Soak test: a local cluster under steady load for N minutes, then checked for leaks.

    1. start a deployment (embedded Redis, local Ray, N CPU or GPU workers, the coordinator)
    2. measure capacity: closed loop, `--concurrency` clients back to back for `--capacity-s`
    3. soak: open loop at `--load` x capacity (or a fixed `--rate`) for `--minutes`: requests are
       sent on schedule (Poisson arrivals) whether or not earlier ones finished
    4. drain, then check: zero errors; no block leak (every pool's free blocks equal its size
       once nothing runs, via ListWorkers, and every pool passes check_invariants); the index
       equals the pools; RSS growth of the coordinator, each worker and Redis from the end of
       the first minute (warm) to the end (Redis is shown but not judged: its event stream
       grows by design up to its cap)

Usage: python benchmarks/soak.py [--minutes 10] [--load 0.8] [--workers 2] [--json out.json]
Prints one table; exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.integration helpers

from local_ray import start_local_ray

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig  # noqa: E402
from kvmesh.coordinator.config import CoordinatorConfig  # noqa: E402
from kvmesh.proto import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc  # noqa: E402
from kvmesh.workers.config import WorkerConfig  # noqa: E402
from tests.integration.fault_helpers import index_matches_pools  # noqa: E402


@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)


class Load:
    """Prompts from `num_families` shared 2-block prefixes plus a random tail, like chat turns."""

    def __init__(self, stub: pb_grpc.KVMeshStub, max_tokens: int, seed: int = 0) -> None:
        self.stub = stub
        self.max_tokens = max_tokens
        self.counts = Counts()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def prompt(self) -> list[int]:
        with self._lock:
            family = self._rng.randrange(16)
            tail = [self._rng.randrange(3, 300) for _ in range(self._rng.randrange(4, 40))]
        return [3 + (family * 37 + i * 11) % 300 for i in range(32)] + tail

    def one(self) -> None:
        sampling = pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        request = pb.GenerateRequest(token_ids=self.prompt(), sampling=sampling)
        started = time.perf_counter()
        outcome, code = "ok", ""
        try:
            responses = list(self.stub.Generate(request, timeout=120))
            tokens = sum(len(r.token_ids) for r in responses)
            if not responses or not responses[-1].finish_reason or tokens != self.max_tokens:
                outcome = "lost"
        except grpc.RpcError as err:
            outcome, code = "failed", err.code().name
        with self._lock:
            c = self.counts
            c.sent += 1
            setattr(c, outcome, getattr(c, outcome) + 1)
            if code:
                c.errors[code] = c.errors.get(code, 0) + 1
            if outcome == "ok":
                c.latencies_ms.append((time.perf_counter() - started) * 1e3)


def measure_capacity(stub: pb_grpc.KVMeshStub, args: argparse.Namespace) -> float:
    """Completed requests per second with `concurrency` clients sending back to back."""
    load = Load(stub, args.max_tokens, seed=1)
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            load.one()

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.capacity_s)
    stop.set()
    for t in threads:
        t.join()
    return load.counts.ok / (time.monotonic() - started)


class RssSampler:
    """RSS of named processes, sampled every `interval_s` on a thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 5.0) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        rss = {}
        for name, proc in self.procs.items():
            try:
                rss[name] = proc.memory_info().rss
            except psutil.Error:
                rss[name] = 0
        self.samples.append((time.monotonic(), rss))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def growth(self, warm_s: float) -> dict[str, dict[str, float]]:
        """Per process: MB at the first sample after `warm_s`, MB at the end, growth in %."""
        t0 = self.samples[0][0]
        warm = next((s for t, s in self.samples if t - t0 >= warm_s), self.samples[0][1])
        end = self.samples[-1][1]
        return {
            name: {
                "warm_mb": warm[name] / 2**20,
                "end_mb": end[name] / 2**20,
                "growth_pct": 100.0 * (end[name] - warm[name]) / max(warm[name], 1),
            }
            for name in warm
        }


def soak(stub: pb_grpc.KVMeshStub, rate_rps: float, args: argparse.Namespace) -> Counts:
    """Open loop: Poisson arrivals at `rate_rps` for `args.minutes`, at most `max_in_flight`."""
    load = Load(stub, args.max_tokens, seed=2)
    rng = random.Random(3)
    deadline = time.monotonic() + args.minutes * 60
    next_at = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.max_in_flight) as pool:
        while next_at < deadline:
            time.sleep(max(0.0, next_at - time.monotonic()))
            pool.submit(load.one)
            next_at += rng.expovariate(rate_rps)
    return load.counts


def check_after_drain(d: Deployment, stub: pb_grpc.KVMeshStub) -> dict[str, Any]:
    assert d.cluster is not None and d.redis is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
        if all(w.num_running == 0 and w.num_waiting == 0 for w in workers):
            break
        time.sleep(0.2)
    workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
    leaked = {w.worker_id: w.num_blocks - w.num_free_blocks for w in workers}
    invariants = all(
        ray.get(d.cluster.actor(w).check_invariants.remote()) for w in d.cluster.live_worker_ids()
    )
    consistent = False
    for _ in range(50):
        consistent = index_matches_pools(d, d.redis.url)
        if consistent:
            break
        time.sleep(0.1)
    return {"leaked_blocks": leaked, "invariants_ok": invariants, "index_matches_pools": consistent}


def main() -> int:
    args = parse_args()
    start_local_ray()
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0),
        num_workers=args.workers,
        worker=WorkerConfig(worker_id="template", num_blocks=args.num_blocks, device=args.device),
    )
    d = Deployment(config)
    d.start()
    try:
        stub = pb_grpc.KVMeshStub(grpc.insecure_channel(d.address))
        capacity = measure_capacity(stub, args) if args.rate is None else None
        rate = args.rate if args.rate is not None else args.load * (capacity or 0.0)
        print(f"capacity {capacity} req/s; soaking at {rate:.2f} req/s for {args.minutes} min")
        assert d.redis is not None
        pids = {w.worker_id: w.pid for w in stub.ListWorkers(pb.ListWorkersRequest()).workers}
        pids |= {"coordinator": os.getpid(), "redis": d.redis.process.pid}
        sampler = RssSampler(pids, interval_s=min(5.0, args.minutes * 6)).start()
        sampler.sample()
        counts = soak(stub, rate, args)
        sampler.sample()
        sampler.stop()
        checks = check_after_drain(d, stub)
        report = summarize(args, capacity, rate, counts, checks, sampler)
    finally:
        d.stop()
        ray.shutdown()
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1


def summarize(
    args: argparse.Namespace,
    capacity: float | None,
    rate: float,
    counts: Counts,
    checks: dict[str, Any],
    sampler: RssSampler,
) -> dict[str, Any]:
    lat = sorted(counts.latencies_ms)
    growth = sampler.growth(warm_s=min(60.0, args.minutes * 60 / 4))
    passed = (
        counts.failed == 0
        and counts.lost == 0
        and not any(checks["leaked_blocks"].values())
        and checks["invariants_ok"]
        and checks["index_matches_pools"]
        # Redis is reported but not judged: its stream grows by design up to its cap
        # (EVENTS_STREAM_MAXLEN entries), so its RSS rises until the cap is reached.
        and all(g["growth_pct"] < 5.0 for name, g in growth.items() if name != "redis")
    )
    return {
        "command": " ".join(sys.argv),
        "cpu_count": os.cpu_count(),
        "minutes": args.minutes,
        "workers": args.workers,
        "capacity_rps": capacity,
        "rate_rps": rate,
        "achieved_rps": counts.sent / (args.minutes * 60),
        "counts": {k: v for k, v in asdict(counts).items() if k != "latencies_ms"},
        "latency_ms": {
            "p50": lat[len(lat) // 2] if lat else None,
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        },
        "checks": checks,
        "rss": growth,
        "passed": passed,
    }


def print_report(report: dict[str, Any]) -> None:
    c, lat = report["counts"], report["latency_ms"]
    print(
        f"sent {c['sent']}  ok {c['ok']}  failed {c['failed']}  lost {c['lost']}  errors"
        f" {c['errors']}  achieved {report['achieved_rps']:.2f} req/s"
        f"  p50 {lat['p50'] or 0:.1f} ms  p99 {lat['p99'] or 0:.1f} ms"
    )
    print(f"checks {report['checks']}")
    for name, g in report["rss"].items():
        print(
            f"  rss {name:12s} {g['warm_mb']:8.1f} MB -> {g['end_mb']:8.1f} MB"
            f"  ({g['growth_pct']:+.2f} %)"
        )
    print("PASSED" if report["passed"] else "FAILED")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    p.add_argument("--rate", type=float, default=None, help="fixed req/s (skips the capacity run)")
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8, help="clients of the capacity run")
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
