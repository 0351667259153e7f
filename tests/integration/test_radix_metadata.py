"""Radix metadata and the cache epoch in a real Redis (no Ray): the event script keeps each
block's link (parent, depth) in its worker's blocks HASH, through demotions, full re-publishes
and purges; a cold coordinator's mirror gets its tree from Redis; the epoch is agreed through
Redis; a Redis written in the layout before (a holder and a node key per block) is read and
cleaned up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.workers.engine.event_publisher import EventPublisher

pytestmark = [pytest.mark.redis]

NS = "00000000000000bb"
BS = 16
ROOT = BlockHash(0x77)
A, B, C, D = (BlockHash(0xA000 + i) for i in range(4))


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = start_redis_server()
    yield s
    s.stop()


@pytest.fixture
def url(server: RedisServer) -> str:
    redis.Redis.from_url(server.url).flushall()
    return server.url


class Writer:
    """One worker's publisher, numbering its batches."""

    def __init__(self, url: str, worker: str) -> None:
        self.publisher = EventPublisher(url, NS, worker)
        self.publisher.heartbeat({"block_size": BS}, 10_000)
        self.worker, self.generation, self.seq = worker, 1, 0

    def send(self, *events: object, new_generation: bool = False) -> None:
        if new_generation:
            self.generation, self.seq = self.generation + 1, 0
        self.seq += 1
        batch = EventBatch(self.worker, self.generation, self.seq, tuple(events))  # type: ignore[arg-type]
        assert self.publisher.publish(batch).ok


def node(url: str, h: int) -> dict[str, str]:
    """The block's link as readers see it (from any worker holding it)."""
    return IndexStore(url).node(NS, BlockHash(h))


def worker_link(url: str, h: int, worker: str) -> dict[str, str]:
    """The block's link in `worker`'s blocks HASH only ({}: none, or not held)."""
    raw = redis.Redis.from_url(url).hget(schema.worker_blocks_key(worker), schema.hash_hex(h))
    if raw is None or raw[1:17] == schema.NO_PARENT_HEX.encode():
        return {}
    depth = int(raw[17:], 16)
    return {"p": raw[1:17].decode(), "d": str(depth), "t": str(depth * BS)}


def link(parent: int, depth: int) -> dict[str, str]:
    return {"p": schema.hash_hex(BlockHash(parent)), "d": str(depth), "t": str(depth * BS)}


def test_stored_chain_gets_parent_depth_and_tokens(url: str) -> None:
    w = Writer(url, "w0")
    w.send(BlockStored((A, B, C), parent_hash=ROOT, depth=1))
    assert [node(url, h) for h in (A, B, C)] == [link(ROOT, 1), link(A, 2), link(B, 3)]
    w.send(BlockStored((D,), parent_hash=A))  # depth unknown to the writer: from the parent
    assert node(url, D) == link(A, 2)


def test_node_lives_as_long_as_some_worker_holds_the_block(url: str) -> None:
    w0, w1 = Writer(url, "w0"), Writer(url, "w1")
    w0.send(BlockStored((A, B), parent_hash=ROOT, depth=1))
    w1.send(BlockStored((A,), parent_hash=ROOT, depth=1))
    w0.send(BlockRemoved((A, B)))
    assert node(url, A) == link(ROOT, 1) and node(url, B) == {}
    IndexStore(url).purge_worker(NS, "w1")
    assert node(url, A) == {}


def test_each_worker_keeps_the_links_of_the_blocks_it_holds(url: str) -> None:
    assert schema.index_shard("w0") != schema.index_shard("w1")
    w0, w1 = Writer(url, "w0"), Writer(url, "w1")
    w0.send(BlockStored((A, B), parent_hash=ROOT, depth=1))
    w1.send(BlockStored((A,), parent_hash=ROOT, depth=1))
    assert worker_link(url, A, "w0") == worker_link(url, A, "w1") == link(ROOT, 1)
    assert worker_link(url, B, "w0") == link(A, 2) and worker_link(url, B, "w1") == {}
    w1.send(BlockStored((B,), parent_hash=A))  # depth from the parent's value in w1's HASH
    assert worker_link(url, B, "w1") == link(A, 2)
    w0.send(BlockRemoved((A, B)))  # w0 holds neither; w1 keeps its links
    assert worker_link(url, A, "w0") == worker_link(url, B, "w0") == {}
    assert node(url, A) == link(ROOT, 1) and node(url, B) == link(A, 2)
    snap = IndexStore(url).snapshot("w1")
    assert snap is not None and sorted(snap.links.tuples()) == [(A, ROOT, 1), (B, A, 2)]


def test_a_store_without_a_parent_keeps_the_link_the_block_has(url: str) -> None:
    w = Writer(url, "w0")
    w.send(BlockStored((A, B), parent_hash=ROOT, depth=1))
    w.send(BlockStored((B, C), TIER_HOST))  # B moves tier; C never had a link
    assert worker_link(url, B, "w0") == link(A, 2) and worker_link(url, C, "w0") == {}
    assert IndexStore(url).block_holders(NS, B) == {"w0": TIER_HOST}
    w.send(BlockStored((C,), parent_hash=B))  # the parent's depth, from the worker's HASH
    assert worker_link(url, C, "w0") == link(B, 3)
    w.send(BlockStored((C,), parent_hash=D))  # D not held, depth unknown: the link stays
    assert worker_link(url, C, "w0") == link(B, 3)


def test_demotion_and_full_republish_keep_the_links(url: str) -> None:
    w = Writer(url, "w0")
    w.send(BlockStored((A, B), parent_hash=ROOT, depth=1))
    w.send(BlockRemoved((B,)), BlockStored((B,), TIER_HOST))  # evicted to the host tier
    assert node(url, B) == link(A, 2)
    assert IndexStore(url).block_holders(NS, B) == {"w0": TIER_HOST}
    # The worker lost its events and re-publishes everything under a new generation.
    w.send(
        AllCleared(),
        BlockStored((B,), TIER_HOST),
        BlockStored((A,), parent_hash=ROOT, depth=1),
        new_generation=True,
    )
    assert node(url, A) == link(ROOT, 1) and node(url, B) == link(A, 2)
    # Redis restarted empty: the re-publish alone brings the device links back.
    redis.Redis.from_url(url).flushall()
    w.publisher.heartbeat({"block_size": BS}, 10_000)
    w.send(AllCleared(), BlockStored((A, B), parent_hash=ROOT, depth=1), new_generation=True)
    assert node(url, B) == link(A, 2)


def test_a_cold_coordinator_reads_the_tree_from_redis(url: str) -> None:
    w = Writer(url, "w0")
    w.send(BlockStored((A, B, C), parent_hash=ROOT, depth=1))
    w.send(BlockStored((D,), parent_hash=A, depth=2))
    store = IndexStore(url)
    redis.Redis.from_url(url).delete(*schema.EVENTS_STREAMS)  # nothing to replay: keys only
    mirror = LockedMirror()
    follower = IndexFollower(store, mirror, ns=NS)
    assert follower.rebuild() == 4
    assert mirror.num_tree_nodes == 0  # serving already: the tree is filled in after
    assert follower.load_links(max_blocks=3) == 3
    assert follower.load_links() == 1
    views, num_nodes = mirror.tree_nodes(10)
    assert num_nodes == 4
    assert {(v.node.block_hash, v.node.parent_hash, v.node.depth) for v in views} == {
        (A, ROOT, 1),
        (B, A, 2),
        (C, B, 3),
        (D, A, 2),
    }
    assert mirror.check_links().ok
    mirror.check_invariants()


def test_the_cache_epoch_is_agreed_through_redis(url: str) -> None:
    store = IndexStore(url)
    first, second = (IndexFollower(store, LockedMirror(), ns=NS) for _ in range(2))
    first.rebuild()
    second.rebuild()
    assert first.bump_cache_epoch() == 1
    assert EventPublisher(url, NS, "w9").cache_epoch() == 1  # what a worker starting now reads
    second.rebuild()
    assert second.cache_epoch == 1
    assert second.bump_cache_epoch() == 2
    assert store.bump_cache_epoch(NS, at_least=10) == 10  # a coordinator that knew a higher one


def test_the_epoch_outlives_a_redis_that_lost_it(url: str) -> None:
    w = Writer(url, "w0")
    w.publisher.heartbeat({"block_size": BS, "cache_epoch": 3}, 10_000)  # reset 3 times before
    follower = IndexFollower(IndexStore(url), LockedMirror(), ns=NS)
    follower.rebuild()
    assert follower.cache_epoch == 3  # from the worker's report: the epoch key was never set
    redis.Redis.from_url(url).flushall()  # Redis restarted empty
    follower.rebuild()
    assert follower.cache_epoch == 3
    assert EventPublisher(url, NS, "w9").cache_epoch() == 3  # put back for workers starting now


def _write_old_layout(url: str, worker: str, hashes: tuple[int, ...]) -> list[str]:
    """What a worker of the layout before links wrote for a chain: its info, one-digit values,
    a holder key and a node key per block; returns the per-block keys."""
    client = redis.Redis.from_url(url)
    prefix = f"{schema.shard_prefix(schema.index_shard(worker))}{NS}:"
    client.hset(schema.worker_key(worker), mapping={"generation": 1, "seq": 1, "ns": NS})
    client.sadd(schema.workers_key(schema.index_shard(worker)), worker)
    keys = []
    for parent, h in zip((ROOT, *hashes[:-1]), hashes, strict=True):
        client.hset(schema.worker_blocks_key(worker), schema.hash_hex(h), "0")
        client.hset(f"{prefix}blk:{schema.hash_hex(h)}", worker, "0")
        client.hset(f"{prefix}node:{schema.hash_hex(h)}", mapping={"p": schema.hash_hex(parent)})
        keys += [f"{prefix}blk:{schema.hash_hex(h)}", f"{prefix}node:{schema.hash_hex(h)}"]
    return keys


def test_the_layout_before_links_is_read_and_wiped_by_a_new_generation_or_a_purge(
    url: str,
) -> None:
    client = redis.Redis.from_url(url)
    old_keys = _write_old_layout(url, "w0", (A, B))
    snap = IndexStore(url).snapshot("w0")
    assert snap is not None and sorted(snap.blocks) == [(A, 0), (B, 0)] and not len(snap.links)
    w = Writer(url, "w0")
    w.send(BlockStored((C,), parent_hash=ROOT, depth=1), new_generation=True)
    assert client.exists(*old_keys) == 0
    assert client.hkeys(schema.worker_blocks_key("w0")) == [schema.hash_hex(C).encode()]
    old_keys = _write_old_layout(url, "w1", (A,))
    assert IndexStore(url).purge_worker(NS, "w1") == 1
    assert client.exists(*old_keys, schema.worker_blocks_key("w1")) == 0


def test_events_of_thousands_of_blocks_are_applied_whole(url: str) -> None:
    chain = tuple(BlockHash(0x10_0000 + i) for i in range(5000))  # past the scripts' 4,000
    w = Writer(url, "w0")
    w.send(BlockStored(chain, parent_hash=ROOT, depth=1))
    w.send(BlockRemoved(chain[:4500]), BlockStored(chain[:4500], TIER_HOST))  # demoted
    snap = IndexStore(url).snapshot("w0")
    assert snap is not None
    assert dict(snap.blocks) == {h: TIER_HOST if i < 4500 else 0 for i, h in enumerate(chain)}
    parents = (ROOT, *chain[:-1])
    assert sorted(snap.links.tuples()) == sorted(zip(chain, parents, range(1, 5001), strict=True))
    w.send(BlockRemoved(chain[:4500], TIER_HOST))
    snap = IndexStore(url).snapshot("w0")
    assert snap is not None and sorted(h for h, _ in snap.blocks) == sorted(chain[4500:])


def test_a_cold_mirror_links_a_block_from_any_worker_that_recorded_its_link(url: str) -> None:
    w0, w1 = Writer(url, "w0"), Writer(url, "w1")
    w0.send(BlockStored((A, B), TIER_HOST))  # w0 knows no links
    w1.send(BlockStored((A, B), parent_hash=ROOT, depth=1))
    mirror = LockedMirror()
    follower = IndexFollower(IndexStore(url), mirror, ns=NS)
    assert follower.rebuild() == 4
    assert follower.load_links() == 2
    views, num_nodes = mirror.tree_nodes(10)
    assert num_nodes == 2
    assert {(v.node.block_hash, v.node.parent_hash, v.node.depth) for v in views} == {
        (A, ROOT, 1),
        (B, A, 2),
    }
    IndexStore(url).purge_worker(NS, "w1")  # w0 alone holds them now, without links
    assert node(url, A) == {} and IndexStore(url).block_holders(NS, A) == {"w0": TIER_HOST}
