"""The index sharded over a real local Redis Cluster (3 masters, started from the same
redis-server binary as every other test): each worker's keys sit in its shard's slot, the event
and purge scripts run there atomically, and followers rebuild, follow, resync and purge across
the shards exactly as on one Redis."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvmesh.coordinator.cluster.redis_server import RedisClusterServers, start_redis_cluster
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import AllCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.proto.request_notes import NoteBatch, RequestFinished, RequestTaken
from kvmesh.workers.engine.event_publisher import EventPublisher
from tests.integration.index_helpers import drain, follower_for, stored

pytestmark = [pytest.mark.redis]

NS = "00000000000000bb"
GEN = 7
WORKERS = [f"w{i}" for i in range(12)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    c = start_redis_cluster(num_masters=3)
    yield c
    c.stop()


@pytest.fixture
def url(cluster: RedisClusterServers) -> str:
    client = _client(cluster.url)
    for node in client.get_primaries():
        client.get_redis_connection(node).flushall()
    return cluster.url


def _client(url: str) -> Any:
    plain, is_cluster = schema.cluster_url(url)
    assert is_cluster
    return redis.RedisCluster.from_url(plain)


def test_every_key_of_a_worker_sits_in_its_shards_slot_and_the_shards_spread(url: str) -> None:
    client = _client(url)
    for i, w in enumerate(WORKERS):
        pub = EventPublisher(url, NS, w)
        assert pub.publish(EventBatch(w, GEN, 1, (stored(1, 2, 100 + i),))).ok
        assert pub.heartbeat({"node": "n"}, 3000)
    keys_per_node = []
    for node in client.get_primaries():
        keys = [k.decode() for k in client.get_redis_connection(node).keys("kvmesh:*")]
        keys_per_node.append(len(keys))
        for key in keys:  # a key is stored only on the master that owns its slot
            assert client.get_node_from_key(key).name == node.name, key
    assert all(n > 0 for n in keys_per_node), keys_per_node  # 12 workers reach all 3 masters
    for w in WORKERS:
        slot = client.keyslot(schema.worker_key(w))
        assert {client.keyslot(k) for k in schema.purge_worker_keys(w)} == {slot}
        value = client.hget(schema.worker_blocks_key(w), schema.hash_hex(1))
        assert value == schema.block_value(0, 0, 0).encode()
    # Block 1 is held by all 12 workers, whose holders live in several shards: all are found.
    assert IndexStore(url).block_holders(NS, BlockHash(1)) == dict.fromkeys(WORKERS, 0)


def test_a_batch_is_applied_whole_and_a_new_generation_wipes_on_the_cluster(url: str) -> None:
    client = _client(url)
    pub = EventPublisher(url, NS, "w0")
    pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2, 3), BlockRemoved((BlockHash(2),)))))
    assert set(client.hkeys(schema.worker_blocks_key("w0"))) == {
        schema.hash_hex(h).encode() for h in (1, 3)
    }
    assert pub.publish(EventBatch("w0", GEN, 1, (stored(9),))).num_applied == 0  # duplicate
    pub.publish(EventBatch("w0", GEN + 1, 1, (stored(5),)))  # restarted: old blocks wiped
    assert client.hkeys(schema.worker_blocks_key("w0")) == [schema.hash_hex(5).encode()]
    pub.publish(EventBatch("w0", GEN + 1, 2, (AllCleared(),)))
    assert not client.exists(schema.worker_blocks_key("w0"))


def test_request_notes_ride_the_shard_streams_on_the_cluster(url: str) -> None:
    pub = EventPublisher(url, NS, "w3")
    taken = RequestTaken("r1", "c0", 48, 16)
    assert pub.publish(EventBatch("w3", GEN, 1, (stored(1, 2, 3),)), NoteBatch("w3", (taken,))).ok
    store = IndexStore(url)
    store.append_notes([NoteBatch("w3", (RequestFinished("r1"),))])  # as a coordinator sends
    entries = [e for e in store.read_stream({}, None) if e.stream == schema.worker_events_key("w3")]
    w3 = [e for e in entries if (e.batch or e.notes) and (e.batch or e.notes).worker_id == "w3"]
    assert [e.batch.seq for e in w3 if e.batch is not None] == [1]
    assert [n for e in w3 if e.notes is not None for n in e.notes.notes] == [
        taken,
        RequestFinished("r1"),
    ]


def test_followers_rebuild_follow_resync_and_purge_across_shards(url: str) -> None:
    pubs = {w: EventPublisher(url, NS, w) for w in WORKERS}
    for i, (w, pub) in enumerate(pubs.items()):
        pub.publish(EventBatch(w, GEN, 1, (stored(1000 * i + 1, 1000 * i + 2),)))
    follower = follower_for(url, NS)
    assert follower.mirror.num_blocks == 2 * len(WORKERS)
    late = follower_for(url, NS)
    for i, (w, pub) in enumerate(pubs.items()):
        pub.publish(EventBatch(w, GEN, 2, (stored(1000 * i + 3),)))
    drain(follower)
    # A lost batch of w5 (deleted from its shard's stream) is a gap: the follower resyncs w5.
    client = _client(url)
    pubs["w5"].publish(EventBatch("w5", GEN, 3, (stored(5004),)))
    stream = schema.worker_events_key("w5")
    client.xdel(stream, client.xrevrange(stream, count=1)[0][0])
    pubs["w5"].publish(EventBatch("w5", GEN, 4, (stored(5005),)))
    resyncs = follower.num_resyncs
    drain(follower)
    assert follower.num_resyncs == resyncs + 1
    store = IndexStore(url)
    for w in WORKERS:
        snap = store.snapshot(w)
        assert snap is not None
        assert follower.mirror.worker_hashes(WorkerId(w)) == dict(snap.blocks)
    # A purge, from another coordinator, reaches this follower through w7's shard stream.
    assert store.purge_worker(NS, "w7") == 3
    assert not client.exists(schema.worker_key("w7"), schema.worker_blocks_key("w7"))
    drain(follower)
    drain(late)
    assert follower.mirror.num_worker_blocks(WorkerId("w7")) == 0
    assert WorkerId("w7") not in late.mirror.workers()
    assert "w7" not in store.worker_ids() and len(store.worker_ids()) == len(WORKERS) - 1
    for f in (follower, late):
        f.mirror.check_invariants()
    assert late.mirror.num_blocks == follower.mirror.num_blocks == 3 * (len(WORKERS) - 1) + 2


def _publish(url: str, worker: str, num_batches: int, batch_blocks: int) -> None:
    pub = EventPublisher(url, NS, worker)
    base = int(worker[1:]) * 1_000_000
    for b in range(num_batches):
        first = base + b * batch_blocks + 1
        pub.publish(EventBatch(worker, GEN, b + 1, (stored(*range(first, first + batch_blocks)),)))


@pytest.mark.slow
def test_publishers_in_several_processes_fill_the_cluster_and_the_mirror(url: str) -> None:
    follower = follower_for(url, NS)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_publish, args=(url, f"w{i}", 20, 100)) for i in range(4)]
    for p in procs:
        p.start()
    while follower.mirror.num_blocks < 4 * 20 * 100:
        follower.poll_once(block_ms=50)
        assert all(p.exitcode in (None, 0) for p in procs)
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    store = IndexStore(url)
    for i in range(4):
        snap = store.snapshot(f"w{i}")
        assert snap is not None and len(snap.blocks) == 2000
        assert follower.mirror.cursor(WorkerId(f"w{i}")) == (GEN, 20)
    follower.mirror.check_invariants()


def test_radix_links_live_in_each_holders_hash_and_a_cold_follower_links_them(url: str) -> None:
    client = _client(url)
    root, chain = BlockHash(0x77), [BlockHash(0xA000 + i) for i in range(3)]
    workers = ["w0", "w1", "w2"]  # three different shards
    assert len({schema.index_shard(w) for w in workers}) == 3
    for w in workers:
        pub = EventPublisher(url, NS, w)
        assert pub.heartbeat({"block_size": 16}, 10_000)
        assert pub.publish(EventBatch(w, GEN, 1, (BlockStored(tuple(chain), 0, root, 1),))).ok
    for w in workers:
        value = client.hget(schema.worker_blocks_key(w), schema.hash_hex(chain[2]))
        assert value == schema.block_value(0, chain[1], 3).encode()
    store = IndexStore(url)
    for w in workers[:2]:
        store.purge_worker(NS, w)
        assert not client.exists(schema.worker_blocks_key(w))
    assert store.node(NS, chain[2]) == {"p": schema.hash_hex(chain[1]), "d": "3", "t": "48"}
    follower = follower_for(url, NS)  # cold: links come from w2's snapshot
    assert follower.load_links() == 3
    views, num_nodes = follower.mirror.tree_nodes(10)
    assert num_nodes == 3 and follower.mirror.check_links().ok
    assert [(v.node.parent_hash, v.node.depth) for v in views] == [
        (root, 1),
        (chain[0], 2),
        (chain[1], 3),
    ]
    follower.mirror.check_invariants()
