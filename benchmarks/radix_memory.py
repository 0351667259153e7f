"""Memory per block of the index and its radix metadata, measured:

  * Redis: `used_memory` of the whole index per block held by one worker (its blocks HASH, each
    value carrying the block's tier and link), and `MEMORY USAGE` of that HASH per block (the
    allocator's view)
  * the coordinator's mirror: bytes traced while its radix tree links the blocks (the hash ints
    themselves are shared with the index and not counted)

Blocks are published the way a worker does (chains of 64 blocks, one event batch per chain). It
also times what the links cost the event script: stored blocks applied per second by one
publisher, with links and without (host-tier stores name no parent: the script works out their
values, keeping any link the block had).

Usage: python benchmarks/radix_memory.py [--blocks N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import redis

from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.coordinator.index.radix_tree import RadixTree
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.engine.event_publisher import EventPublisher

NS = "00000000000000cc"
CHAIN_BLOCKS = 64


def chains(num_blocks: int, seed: int = 0) -> list[list[BlockHash]]:
    rng = random.Random(seed)
    hashes = [BlockHash(rng.getrandbits(64)) for _ in range(num_blocks)]
    return [hashes[i : i + CHAIN_BLOCKS] for i in range(0, num_blocks, CHAIN_BLOCKS)]


def redis_bytes_per_block(num_blocks: int) -> dict[str, Any]:
    server = start_redis_server()
    try:
        client = redis.Redis.from_url(server.url)
        publisher = EventPublisher(server.url, NS, "w0")
        publisher.heartbeat({"block_size": 16}, 60_000)
        empty = int(client.info("memory")["used_memory"])
        root = BlockHash(1)
        for seq, chain in enumerate(chains(num_blocks), start=1):
            batch = EventBatch("w0", 1, seq, (BlockStored(tuple(chain), 0, root, 1),))
            assert publisher.publish(batch).ok
        client.delete(*schema.EVENTS_STREAMS)
        with_blocks = int(client.info("memory")["used_memory"])
        usage = int(client.memory_usage(schema.worker_blocks_key("w0"), samples=0) or 0)
        publisher.close()
        return {
            "redis_bytes_per_block": (with_blocks - empty) / num_blocks,
            "memory_usage_of_the_blocks_hash_per_block": usage / num_blocks,
        }
    finally:
        server.stop()


def ingest_blocks_per_s(num_blocks: int) -> dict[str, float]:
    server = start_redis_server()
    try:
        out = {}
        for label, parent, depth in (("without_links", 0, 0), ("with_links", 1, 1)):
            worker = f"w{parent}"
            publisher = EventPublisher(server.url, NS, worker)
            publisher.heartbeat({"block_size": 16}, 60_000)
            batches = [
                EventBatch(worker, 1, seq, (BlockStored(tuple(c), 0, BlockHash(parent), depth),))
                for seq, c in enumerate(chains(num_blocks, seed=2 + parent), start=1)
            ]
            started = time.perf_counter()
            for batch in batches:
                assert publisher.publish(batch).ok
            out[f"ingest_blocks_per_s_{label}"] = num_blocks / (time.perf_counter() - started)
            publisher.close()
        return out
    finally:
        server.stop()


def mirror_tree_bytes_per_node(num_blocks: int) -> float:
    all_chains = chains(num_blocks, seed=1)
    tree = RadixTree()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for chain in all_chains:
        tree.link(chain, BlockHash(1), 1)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert tree.num_nodes == num_blocks
    return (after - before) / num_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = redis_bytes_per_block(args.blocks)
    result["mirror_tree_bytes_per_node"] = mirror_tree_bytes_per_node(args.blocks)
    result.update(ingest_blocks_per_s(min(args.blocks, 100_000)))
    result["num_blocks"] = args.blocks
    for key, value in result.items():
        print(f"{key:36} {value:,.1f}" if isinstance(value, float) else f"{key:36} {value:,}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
