"""What observability costs: building the metric families, a full HTTP scrape, and the two
request observers (metrics, request log) per request. Goal: a scrape well under Prometheus'
default 10 s timeout and a per-request cost far below a TTFT.

  * collect(), 16 workers with reports and 10K requests recorded
  * GET /metrics over HTTP (loopback), same state
  * RequestMetrics + RequestLog per finished request, log line off (level warning) and on (JSON)

Usage: python benchmarks/telemetry_cost.py
"""

from __future__ import annotations

import io
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.exporter import MetricsExporter
from kvmesh.coordinator.telemetry.log_format import LogConfig, configure_logging
from kvmesh.coordinator.telemetry.request_log import RequestLog
from kvmesh.coordinator.telemetry.request_metrics import RequestMetrics
from kvmesh.coordinator.telemetry.request_record import RequestRecord
from kvmesh.workers.contract.replies import WorkerCounters, WorkerInfo

NUM_WORKERS = 16


class StaticCoordinator:
    def stats(self) -> dict[str, Any]:
        return {"prompt_tokens": 10, "cached_tokens": 5, "hit_rate": 0.5}

    def indexed_blocks_of(self, worker_id: str) -> int:
        return 1000


def percentiles_ms(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3


def main() -> None:
    registry = WorkerRegistry()
    infos = {}
    for i in range(NUM_WORKERS):
        w = f"w{i}"
        registry.add(w)
        infos[w] = WorkerInfo(w, 1, "n", "cuda:0", "m", 16, 10_000, 5_000, 4_000, 8, 2, 1,
                              WorkerCounters())  # fmt: skip
    metrics = RequestMetrics()
    record = RequestRecord(
        "r", "r", "ok", worker_id="w1", ttft_s=0.01, prompt_tokens=67, cached_tokens=64,
        computed_tokens=3,
    )  # fmt: skip
    for _ in range(10_000):
        metrics.on_routed(0.0004)
        metrics.on_request_done(record)
    collector = MetricsCollector(StaticCoordinator(), registry, infos.get, metrics)
    p50, p99 = percentiles_ms(collector.collect, 2000)
    print(f"collect(), {NUM_WORKERS} workers: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    exporter = MetricsExporter("127.0.0.1", 0)
    exporter.serve(collector)
    url = f"http://{exporter.address}/metrics"
    size = len(urllib.request.urlopen(url).read())
    p50, p99 = percentiles_ms(lambda: urllib.request.urlopen(url).read(), 300)
    print(f"GET /metrics ({size} bytes): p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    exporter.stop()
    log = RequestLog()

    def observe() -> None:
        metrics.on_request_done(record)
        log.on_request_done(record)

    configure_logging(LogConfig("warning", json_lines=True), io.StringIO())
    p50, p99 = percentiles_ms(observe, 20_000)
    print(f"observers per request, log line off: p50 {p50 * 1e3:.1f} us, p99 {p99 * 1e3:.1f} us")
    configure_logging(LogConfig("info", json_lines=True), io.StringIO())
    p50, p99 = percentiles_ms(observe, 20_000)
    print(f"observers per request, JSON line on: p50 {p50 * 1e3:.1f} us, p99 {p99 * 1e3:.1f} us")


if __name__ == "__main__":
    main()
