"""An engine's KV events over real ZMQ into the real Redis index: in-order batches, gaps
replayed through the ROUTER socket, gaps nobody can replay and engine restarts clearing the
engine's entries, malformed payloads skipped, and one feeder among coordinators sharing an
engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.coordinator.engines import vllm_events
from kvmesh.coordinator.engines.chain_translator import ChainTranslator
from kvmesh.coordinator.engines.event_subscriber import EngineEventSubscriber, SubscriberConfig
from kvmesh.coordinator.engines.index_feed import EngineIndexFeed
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto.block_hash import BlockHash, block_hashes, namespace_hash
from kvmesh.workers.engine.event_publisher import EventPublisher
from tests.integration.engine_stand_in import StandInEngine, removed, stored
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.redis

BS = 4
NS = "engine-test"
ENGINE = "e0"


def _root(lora: str, salt: str = "") -> BlockHash:
    return namespace_hash("fp", lora, salt)


class Rig:
    def __init__(
        self,
        redis: RedisServer,
        engine: StandInEngine,
        *,
        replay: bool = True,
        feeding: bool = True,
    ) -> None:
        self.engine = engine
        self.store = IndexStore(redis.url)
        publisher = EventPublisher(redis.url, NS, ENGINE)
        self.feed = EngineIndexFeed(ENGINE, ChainTranslator(BS, _root), publisher, feeding=feeding)
        config = SubscriberConfig(
            engine.events_endpoint, engine.replay_endpoint if replay else "", "kv"
        )
        self.subscriber = EngineEventSubscriber(
            config, vllm_events.decode_payload, self.feed.on_batch, self.feed.on_reset, name="e0"
        )
        self.subscriber.start()
        self.subscriber.subscribed.wait(5)

    def redis_blocks(self) -> set[int]:
        snapshot = self.store.snapshot(ENGINE)
        return {int(h) for h, _ in snapshot.blocks} if snapshot is not None else set()

    def close(self) -> None:
        self.subscriber.stop()
        self.store.close()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    e = StandInEngine()
    yield e
    e.close()


@pytest.fixture
def rig(redis: RedisServer, engine: StandInEngine) -> Iterator[Rig]:
    r = Rig(redis, engine)
    yield r
    r.close()


TOKENS = list(range(3 * BS))
CHAIN = [int(h) for h in block_hashes(TOKENS, BS, _root(""))]


def test_blocks_stored_and_removed_reach_redis_under_kvmesh_hashes(rig: Rig) -> None:
    rig.engine.publish([stored([11, 12], None, TOKENS[: 2 * BS], BS)])
    rig.engine.publish([stored([b"\x0d" * 32], 12, TOKENS[2 * BS :], BS)])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN), 20.0, what="all three blocks")
    rig.engine.publish([removed([b"\x0d" * 32])])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN[:2]), 20.0, what="the removal")
    assert rig.subscriber.counters.num_resets == 0


def test_a_gap_is_replayed_through_the_router_socket(rig: Rig) -> None:
    rig.engine.publish([stored([11], None, TOKENS[:BS], BS)])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN[:1]), 20.0, what="the first block")
    rig.engine.publish([stored([12], 11, TOKENS[BS : 2 * BS], BS)], send=False)  # lost live
    rig.engine.publish([stored([13], 12, TOKENS[2 * BS :], BS)])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN), 20.0, what="the replayed chain")
    assert rig.subscriber.counters.num_gaps == 1
    assert rig.subscriber.counters.num_resets == 0


def test_a_gap_nobody_can_replay_clears_the_engine(rig: Rig) -> None:
    rig.engine.publish([stored([11], None, TOKENS[:BS], BS)])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN[:1]), 20.0, what="the first block")
    generation = rig.feed.generation
    rig.engine.publish([removed([11])], send=False, keep=False)  # lost for good
    rig.engine.publish([stored([21], None, [9] * BS, BS)])
    other = int(block_hashes([9] * BS, BS, _root(""))[0])
    # block 11 may or may not still be there: kvmesh no longer knows, so it is dropped
    wait_for(lambda: rig.redis_blocks() == {other}, 20.0, what="the engine's state after the reset")
    assert rig.subscriber.counters.num_resets == 1 and rig.feed.generation > generation


def test_an_engine_restart_clears_its_blocks(rig: Rig) -> None:
    for i in range(3):
        rig.engine.publish([stored([100 + i], None, [i] * BS, BS)])
    wait_for(lambda: len(rig.redis_blocks()) == 3, 20.0, what="three blocks")
    rig.engine.restart()
    rig.engine.publish([stored([7], None, TOKENS[:BS], BS)])  # seq 0 again
    wait_for(lambda: rig.redis_blocks() == set(CHAIN[:1]), 20.0, what="only the new engine's block")
    assert rig.subscriber.counters.num_resets == 1


def test_malformed_payloads_and_events_are_counted_and_the_stream_goes_on(rig: Rig) -> None:
    rig.engine.publish_raw(b"\xc1 not msgpack")
    rig.engine.publish([{"type": "Mystery"}, stored([11], None, TOKENS[:BS], BS)])
    wait_for(lambda: rig.redis_blocks() == set(CHAIN[:1]), 20.0, what="the good event")
    counters = rig.subscriber.counters
    assert counters.num_undecodable == 1 and counters.num_skipped_events == 1


def test_blocks_published_before_the_subscriber_came_are_replayed(
    redis: RedisServer, engine: StandInEngine
) -> None:
    engine.publish([stored([11, 12, 13], None, TOKENS, BS)])
    late = Rig(redis, engine)
    try:
        wait_for(lambda: late.redis_blocks() == set(CHAIN), 20.0, what="the replayed blocks")
    finally:
        late.close()


def _generation(store: IndexStore) -> int | None:
    snapshot = store.snapshot(ENGINE)
    return snapshot.generation if snapshot is not None else None


def test_two_coordinators_on_one_engine_feed_it_one_at_a_time(
    redis: RedisServer, engine: StandInEngine
) -> None:
    """Both subscribe; the claim holder alone publishes (no generation war); when it stops,
    the other takes the claim and publishes the whole state it kept, under a new generation."""
    first = Rig(redis, engine, feeding=False)
    second = Rig(redis, engine, feeding=False)
    try:
        assert first.feed.keep_claim("coordinator-a", 10_000)
        assert not second.feed.keep_claim("coordinator-b", 10_000)
        engine.publish([stored([11, 12], None, TOKENS[: 2 * BS], BS)])
        wait_for(lambda: first.redis_blocks() == set(CHAIN[:2]), 20.0, what="the first two blocks")
        wait_for(
            lambda: second.feed.held_hashes() == sorted(CHAIN[:2]), 20.0, what="the second's copy"
        )
        generation = _generation(first.store)
        engine.publish([stored([13], 12, TOKENS[2 * BS :], BS)])
        wait_for(lambda: first.redis_blocks() == set(CHAIN), 20.0, what="the third block")
        wait_for(
            lambda: second.feed.held_hashes() == sorted(CHAIN), 20.0, what="the second's third"
        )
        assert first.feed.keep_claim("coordinator-a", 10_000)  # renewed, still the feeder
        assert not second.feed.keep_claim("coordinator-b", 10_000)
        assert _generation(first.store) == generation  # nobody wiped the feeder's state
        assert second.feed.seq == 0  # the other published nothing

        first.feed.close()
        first.feed.publisher.release_feed("coordinator-a")  # a clean stop
        assert second.feed.keep_claim("coordinator-b", 10_000)
        assert second.feed.feeding and _generation(second.store) != generation
        assert second.redis_blocks() == set(CHAIN)  # the whole state, from its own copy
        engine.publish([removed([11, 12, 13])])
        wait_for(
            lambda: second.redis_blocks() == set(), 20.0, what="the removal, fed by the second"
        )
    finally:
        first.close()
        second.close()
