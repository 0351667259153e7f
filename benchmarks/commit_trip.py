"""The decision log's commit round trip, by how long the coordinator was idle before it.

Usage: python benchmarks/commit_trip.py [--gaps-ms 0,1,10,50,125] [--json PATH]

A replica commits each routing decision to the decision log in Redis (`decision_log_store.py`:
one compare-and-set script call) before the request goes to its worker, so the trip is part of
every TTFT with replicas. Here one `IndexStore` commits a typical placement (16 new blocks) to a
fresh Redis, sleeping `gap` between commits, as a coordinator that routes a request every `gap`
does; a PING at the same gaps is the floor of any round trip. Printed: p50 / p90 per gap. An
idle process and an idle Redis are woken by the reply and the request (CPU idle states, the
scheduler), which a busy pair are not: the trip depends on the request rate.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.placements import Placement


def trips_us(call: Callable[[], object], gap_s: float, count: int) -> tuple[float, float]:
    """p50 and p90 of `call`'s wall time, in microseconds, with `gap_s` of sleep before each."""
    samples = []
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gaps-ms", default="0,1,10,50,125")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = start_redis_server()
    try:
        store = IndexStore(server.url)
        hashes = tuple(BlockHash(7919 * i + 1) for i in range(16))
        placement = Placement("r", "o" * 16, "w0", "", 8192, 512, 12.5, hashes, 496, hashes[0])
        rows = []
        print(f"{'gap ms':>7}  {'commit p50 / p90 us':>20}  {'PING p50 / p90 us':>18}")
        for gap_ms in (float(g) for g in args.gaps_ms.split(",")):
            count = 300 if gap_ms < 50 else 80
            commit = trips_us(lambda: store.commit_decision(None, placement), gap_ms / 1e3, count)
            ping = trips_us(store.ping, gap_ms / 1e3, count)
            rows.append({"gap_ms": gap_ms, "commit_us": commit, "ping_us": ping})
            commit_col, ping_col = (
                f"{commit[0]:.0f} / {commit[1]:.0f}",
                f"{ping[0]:.0f} / {ping[1]:.0f}",
            )
            print(f"{gap_ms:>7.0f}  {commit_col:>20}  {ping_col:>18}")
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
