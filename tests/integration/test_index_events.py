"""Lost, reordered, stale and malformed KV events against a real Redis (no Ray): the follower
resyncs on a gap, ignores stale and duplicate batches, rejects garbage without applying it, and
two followers (two coordinators) end with the same index as Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from kvmesh.workers.engine.event_publisher import EventPublisher
from tests.integration.index_helpers import drain, follower_for, stored

pytestmark = [pytest.mark.redis]

NS = "00000000000000aa"
GEN = 1000
W0_EVENTS = schema.worker_events_key("w0")  # the stream of w0's shard


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = start_redis_server()
    yield s
    s.stop()


@pytest.fixture
def url(server: RedisServer) -> str:
    redis.Redis.from_url(server.url).flushall()
    return server.url


def redis_blocks(url: str, worker: str) -> dict[BlockHash, int]:
    snap = IndexStore(url).snapshot(worker)
    return dict(snap.blocks) if snap is not None else {}


def last_entry_id(client: redis.Redis) -> bytes:
    return client.xrevrange(W0_EVENTS, count=1)[0][0]  # type: ignore[index]


def test_a_lost_event_is_a_gap_that_triggers_a_resync(url: str) -> None:
    pub, client = EventPublisher(url, NS, "w0"), redis.Redis.from_url(url)
    follower = follower_for(url, NS)
    pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2, 3),)))
    pub.publish(EventBatch("w0", GEN, 2, (BlockRemoved((BlockHash(3),)),)))
    drain(follower)
    assert follower.mirror.worker_hashes(WorkerId("w0")) == {1: 0, 2: 0}
    resyncs = follower.num_resyncs
    pub.publish(EventBatch("w0", GEN, 3, (stored(4, 5),)))
    client.xdel(W0_EVENTS, last_entry_id(client))  # lost on the way to the mirror
    pub.publish(EventBatch("w0", GEN, 4, (stored(6),)))
    drain(follower)
    assert follower.num_resyncs == resyncs + 1
    assert follower.mirror.worker_hashes(WorkerId("w0")) == redis_blocks(url, "w0")
    assert set(redis_blocks(url, "w0")) == {1, 2, 4, 5, 6}
    assert follower.mirror.cursor(WorkerId("w0")) == (GEN, 4)
    follower.mirror.check_invariants()


def test_a_restarted_worker_is_followed_from_its_first_batch_without_a_snapshot(url: str) -> None:
    """A new generation's seq 1 wipes the worker's older blocks in Redis (the event script) and
    in the mirror alike, so the follower reads no snapshot for it; a later batch of a generation
    whose start it missed still resyncs."""
    pub = EventPublisher(url, NS, "w0")
    follower = follower_for(url, NS)
    pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2, 3),)))
    pub.publish(EventBatch("w0", GEN, 2, (stored(4),)))
    drain(follower)
    resyncs = follower.num_resyncs
    pub.publish(EventBatch("w0", GEN + 1, 1, (stored(1, 7),)))  # restarted: 1 again, and 7
    pub.publish(EventBatch("w0", GEN + 1, 2, (BlockRemoved((BlockHash(7),)),)))
    drain(follower)
    assert follower.num_resyncs == resyncs
    assert follower.mirror.worker_hashes(WorkerId("w0")) == redis_blocks(url, "w0") == {1: 0}
    assert follower.mirror.cursor(WorkerId("w0")) == (GEN + 1, 2)
    pub.publish(EventBatch("w0", GEN + 2, 1, (stored(8),)))
    pub.publish(EventBatch("w0", GEN + 2, 2, (stored(9),)))
    client = redis.Redis.from_url(url)
    first = client.xrevrange(W0_EVENTS, count=2)[1][0]  # type: ignore[index]
    client.xdel(W0_EVENTS, first)  # the new generation's start never reaches the mirror
    drain(follower)
    assert follower.num_resyncs == resyncs + 1
    assert follower.mirror.worker_hashes(WorkerId("w0")) == redis_blocks(url, "w0") == {8: 0, 9: 0}
    follower.mirror.check_invariants()


def test_reordered_events_resync_once_then_the_late_one_is_a_duplicate(url: str) -> None:
    pub, client = EventPublisher(url, NS, "w0"), redis.Redis.from_url(url)
    pub.publish(EventBatch("w0", GEN, 1, (stored(1),)))
    follower = follower_for(url, NS)
    late = EventBatch("w0", GEN, 2, (stored(2),))
    early = EventBatch("w0", GEN, 3, (stored(3),))
    pub.publish(late)
    pub.publish(early)
    entries = client.xrevrange(W0_EVENTS, count=2)
    client.xdel(W0_EVENTS, *[e[0] for e in entries])
    for batch in (early, late):  # the stream now carries them in the wrong order
        client.xadd(W0_EVENTS, {"b": encode_batch(batch)})
    resyncs = follower.num_resyncs
    drain(follower)
    assert follower.num_resyncs == resyncs + 1
    assert follower.mirror.worker_hashes(WorkerId("w0")) == {1: 0, 2: 0, 3: 0}
    follower.mirror.check_invariants()


def test_a_stale_generation_is_ignored_and_a_new_one_reloads(url: str) -> None:
    pub, client = EventPublisher(url, NS, "w0"), redis.Redis.from_url(url)
    pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2),)))
    follower = follower_for(url, NS)
    stale = EventBatch("w0", GEN - 1, 99, (stored(66), BlockRemoved((BlockHash(1),))))
    client.xadd(W0_EVENTS, {"b": encode_batch(stale)})  # e.g. a zombie's late write
    pub.publish(EventBatch("w0", GEN, 2, (stored(3),)))
    drain(follower)
    assert follower.mirror.worker_hashes(WorkerId("w0")) == {1: 0, 2: 0, 3: 0}
    # The worker restarts: a new generation wipes its old blocks in Redis and in the mirror.
    pub.publish(EventBatch("w0", GEN + 1, 1, (stored(7),)))
    drain(follower)
    assert follower.mirror.worker_hashes(WorkerId("w0")) == {7: 0} == redis_blocks(url, "w0")
    follower.mirror.check_invariants()


# Garbage for the decoder: raw bytes, and msgpack documents shaped almost like a batch.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_documents = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=6)
    ),
    max_leaves=20,
)
_near_batches = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 2, "1"]), "w": st.sampled_from(["w0", "", 7]), "e": _documents},
    optional={"g": _scalars, "s": _scalars, "t": _scalars},
)
_garbage = st.one_of(
    st.binary(max_size=64),
    _documents.map(lambda d: msgpack.packb(d, use_bin_type=True)),
    _near_batches.map(lambda d: msgpack.packb(d, use_bin_type=True)),
)


def _undecodable(payload: bytes) -> bool:
    try:
        decode_batch(payload)
    except EventDecodeError:
        return True
    return False


def test_malformed_batches_are_rejected_counted_and_never_applied(url: str) -> None:
    pub, client = EventPublisher(url, NS, "w0"), redis.Redis.from_url(url)
    pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2),)))
    follower = follower_for(url, NS)
    seq = [1]

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(payload=_garbage)
    def feed(payload: bytes) -> None:
        if not _undecodable(payload):
            return  # hypothesis built a valid batch by chance: not garbage
        before = (follower.store.num_decode_errors, follower.mirror.worker_hashes(WorkerId("w0")))
        client.xadd(W0_EVENTS, {"b": payload})
        drain(follower)
        assert follower.store.num_decode_errors == before[0] + 1
        assert follower.mirror.worker_hashes(WorkerId("w0")) == before[1]
        # ... and the follower keeps going: the worker's next real batch is applied.
        seq[0] += 1
        pub.publish(EventBatch("w0", GEN, seq[0], (stored(1000 + seq[0]),)))
        drain(follower)
        assert BlockHash(1000 + seq[0]) in follower.mirror.worker_hashes(WorkerId("w0"))

    feed()
    assert follower.store.num_decode_errors >= 50  # the examples were garbage, as intended
    assert follower.mirror.worker_hashes(WorkerId("w0")) == redis_blocks(url, "w0")
    follower.mirror.check_invariants()


def test_two_followers_started_at_different_times_agree_with_redis(url: str) -> None:
    """Two coordinators on one Redis, the second one started (or restarted) mid-stream."""
    pubs = {w: EventPublisher(url, NS, w) for w in ("w0", "w1", "w2")}
    first = follower_for(url, NS)
    second = None
    for step in range(1, 41):
        for i, (w, pub) in enumerate(pubs.items()):
            base = 10_000 * (i + 1)
            events: tuple = (stored(base + step),)
            if step % 3 == 0:
                events += (BlockRemoved((BlockHash(base + step - 1),)),)
            pub.publish(EventBatch(w, GEN, step, events))
        if step == 20:
            second = follower_for(url, NS)  # rebuilt from Redis, then follows the stream
        drain(first)
    assert second is not None
    drain(second)
    for w in pubs:
        expected = redis_blocks(url, w)
        assert first.mirror.worker_hashes(WorkerId(w)) == expected
        assert second.mirror.worker_hashes(WorkerId(w)) == expected
    assert first.mirror.num_blocks == second.mirror.num_blocks == 3 * 27


@pytest.mark.slow
def test_a_restarted_coordinator_rebuilds_a_million_blocks_from_redis(url: str) -> None:
    """1M indexed blocks (4 workers x 250K in chains of 50K with their links, written by the
    real apply script) come back into a fresh mirror from Redis alone, then their radix links
    into its tree. The times are printed and recorded in docs/reliability.md (goal 10 s); the
    test asserts only what was loaded."""
    num_workers, per_worker, per_batch = 4, 250_000, 50_000
    for w in range(num_workers):
        pub = EventPublisher(url, NS, f"w{w}")
        for k in range(per_worker // per_batch):
            first = (w * per_worker + k * per_batch) * 7919 + 1
            hashes = tuple(BlockHash(first + i) for i in range(per_batch))
            stored = BlockStored(hashes, 0, BlockHash(first - 1 or 0x77), 1 + k * per_batch)
            pub.publish(EventBatch(f"w{w}", GEN, k + 1, (stored,)))
    follower = IndexFollower(IndexStore(url, socket_timeout_s=30), LockedMirror(), ns=NS)
    started = time.perf_counter()
    loaded = follower.rebuild()
    elapsed_s = time.perf_counter() - started
    started = time.perf_counter()
    num_links = follower.load_links()
    links_s = time.perf_counter() - started
    print(f"rebuilt {loaded} blocks in {elapsed_s:.2f} s, their links in {links_s:.2f} s more")
    assert loaded == follower.mirror.num_blocks == num_workers * per_worker
    assert follower.mirror.cursor(WorkerId("w3")) == (GEN, per_worker // per_batch)
    assert num_links == loaded and follower.mirror.num_tree_nodes == loaded


def test_a_least_privilege_acl_user_runs_the_whole_index(url: str, server: RedisServer) -> None:
    """The ACL documented in docs/security.md: kvmesh:* keys only, no dangerous commands."""
    redis.Redis.from_url(url).execute_command(
        "ACL", "SETUSER", "kvmesh-test", "reset", "on", ">acl-pw", "~kvmesh:*",
        "+@read", "+@write", "+@stream", "+@scripting", "+@connection", "-@dangerous",
    )  # fmt: skip
    acl_url = f"redis://kvmesh-test:acl-pw@{server.host}:{server.port}/0"
    pub = EventPublisher(acl_url, NS, "w0")
    assert pub.publish(EventBatch("w0", GEN, 1, (stored(1, 2),))).ok
    assert pub.heartbeat({"node": "n"}, 3000)
    follower = follower_for(acl_url, NS)
    pub.publish(EventBatch("w0", GEN, 2, (stored(3),)))
    drain(follower)
    assert follower.mirror.worker_hashes(WorkerId("w0")) == {1: 0, 2: 0, 3: 0}
    assert follower.store.purge_worker(NS, "w0") == 3
    restricted = redis.Redis.from_url(acl_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.set("not-kvmesh", 1)


def test_rediss_urls_configure_tls_connections() -> None:
    """No TLS-enabled redis-server here to connect to; this pins the URL plumbing (redis-py)."""
    tls_url = "rediss://kvmesh:pw@redis.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem"
    for client in (IndexStore(tls_url)._client, EventPublisher(tls_url, NS, "w0")._client):
        pool = client.connection_pool
        assert pool.connection_class is redis.SSLConnection
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
        assert pool.connection_kwargs["username"] == "kvmesh"
