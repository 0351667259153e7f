"""Redis time of the event script per block event, as Redis itself counts it.

One publisher applies chains of 256 blocks (one batch each) to a fresh Redis, with their links
(parent and depth, as a worker sends them) or without; `INFO commandstats` gives the time Redis
spent in the script (`EVALSHA`), which does not count the client's side or the other processes
sharing the machine's cores. Also prints the Redis memory per indexed block.

Usage: python benchmarks/event_script.py [--batches 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import redis

from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.engine.event_publisher import EventPublisher

BATCH_BLOCKS = 256


def script_us_per_block(num_batches: int, linked: bool) -> dict[str, float]:
    server = start_redis_server()
    try:
        client = redis.Redis.from_url(server.url)
        publisher = EventPublisher(server.url, "bench", "w0")
        publisher.heartbeat({"block_size": 16}, 60_000)
        batches = []
        for b in range(num_batches):
            first = b * BATCH_BLOCKS + 1
            hashes = tuple(BlockHash(first + i) for i in range(BATCH_BLOCKS))
            parent, depth = BlockHash(first - 1 if b else 0x77), b * BATCH_BLOCKS + 1
            stored = BlockStored(hashes, 0, parent, depth) if linked else BlockStored(hashes)
            batches.append(EventBatch("w0", 1, b + 1, (stored,)))
        empty = int(client.info("memory")["used_memory"])
        client.config_resetstat()
        for batch in batches:
            assert publisher.publish(batch).ok
        stats = client.info("commandstats")
        script = stats.get("cmdstat_evalsha") or stats["cmdstat_eval"]
        num_blocks = num_batches * BATCH_BLOCKS
        client.delete(*client.keys("*:events"))  # the stream is not the index
        used = int(client.info("memory")["used_memory"])
        publisher.close()
        return {
            "script_us_per_block": float(script["usec"]) / num_blocks,
            "redis_bytes_per_block": (used - empty) / num_blocks,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = {
        label: script_us_per_block(args.batches, linked)
        for label, linked in (("with_links", True), ("without_links", False))
    }
    for label, r in result.items():
        print(
            f"{label:14} script {r['script_us_per_block']:.2f} us/block"
            f"  Redis memory {r['redis_bytes_per_block']:.0f} B/block"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
