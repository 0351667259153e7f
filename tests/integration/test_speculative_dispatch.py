"""Speculative dispatch against a real Redis and real Ray workers: a replica sends a request to
its worker before committing; its commit loses to a peer's, whose decision makes the first
worker the worse choice, so the replica aborts the request there and redirects it. The stream
yields the second worker's tokens only, and they are the right ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.cluster.redis_server import RedisServer
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.decision_stream import DecisionStream
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.placements import decode_placement
from kvmesh.workers.contract.requests import SamplingConfig
from tests.integration.helpers import generate, holds, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

BS = 16
PROMPT = [(i * 11) % 250 + 3 for i in range(70)]  # 4 full blocks
LONG = PROMPT[:64] + [(i * 5) % 250 + 7 for i in range(600)]  # the same 4 blocks, then more


@pytest.fixture
def fleet(ray_session: None, service_redis: RedisServer) -> Iterator[Deployment]:
    """Two workers behind a coordinator that follows the decision log."""
    deployment = start_deployment(
        redis_url=service_redis.url, decision_log=True, speculative_dispatch=True
    )
    try:
        yield deployment
    finally:
        deployment.stop()


def replica(d: Deployment, redis_url: str) -> Coordinator:
    """Another coordinator replica over the same workers, index and log; it does not follow
    the log's stream, so it hears of a peer's decision only when its own commit loses."""
    assert d.coordinator is not None and d.cluster is not None and d.follower is not None
    config = CoordinatorConfig(
        block_size=BS, policy="kvmesh", decision_log=True, speculative_dispatch=True
    )
    c = Coordinator(
        config,
        d.coordinator.model,
        d.cluster,
        d.follower.mirror,
        d.cluster.registry,
        decision_log=DecisionStream(IndexStore(redis_url)),
    )
    c.decisions.skip_to(IndexStore(redis_url).decision_seq())
    return c


def test_a_redirected_request_streams_only_the_second_workers_right_tokens(
    fleet: Deployment, service_redis: RedisServer
) -> None:
    stub = stub_for(fleet.address)
    # w0 holds PROMPT's blocks; its answer there is the reference (greedy, same weights).
    reference = generate(stub, PROMPT, max_tokens=8, worker_id="w0")
    expected = [t for r in reference for t in r.token_ids]
    assert len(expected) == 8
    wait_for(lambda: holds(stub, PROMPT, "w0", 4), what="w0's blocks in the index")

    peer, late = replica(fleet, service_redis.url), replica(fleet, service_redis.url)
    # The peer commits first: a long prompt sharing PROMPT's blocks, so it goes to w0 too and
    # queues a long prefill there.
    heavy = peer.route(peer.prompts.prepare(LONG, "", ""), request_id="heavy", commit=True)
    assert heavy.worker_id == "w0"

    # The late replica decides on what it applied (not the peer's decision): w0, PROMPT's
    # holder. It sends the request there, loses its commit, applies the peer's decision, and
    # now w1 is cheaper: it aborts the request on w0 and redirects it to w1.
    sampling = SamplingConfig(max_tokens=8, ignore_eos=True)
    stream = late.generate(late.prompts.prepare(PROMPT, "", ""), sampling, request_id="spec")
    stats = late.stats()
    assert (stats["num_speculative_sends"], stats["num_decision_redirects"]) == (1, 1)
    assert (stats["num_decision_commits"], stats["num_decision_lost_commits"]) == (1, 1)
    events = list(stream)
    assert {e.worker_id for e in events} == {"w1"}  # nothing from w0 reached the stream
    assert [t for e in events for t in e.token_ids] == expected
    assert events[-1].finished and events[0].prefill is not None
    assert events[0].prefill.prompt_tokens == len(PROMPT)

    # The log holds the final placements, in order, and the first replica applies them.
    store = IndexStore(service_redis.url)
    assert store.decision_seq() == 2
    logged = redis.Redis.from_url(service_redis.url).xrange(schema.DECISIONS_STREAM)
    placed = [decode_placement(fields[b"d"]) for _, fields in logged]
    assert [(p.request_id, p.worker_id) for p in placed] == [("heavy", "w0"), ("spec.r1", "w1")]
    assert placed[1].origin == late.origin
    assert fleet.coordinator is not None
    cursor = fleet.coordinator.decisions.cursor
    wait_for(lambda: cursor.applied_seq == 2, what="the first replica to apply both entries")
    # w0 dropped the aborted copy: nothing of it stays queued or running on either worker.
    assert fleet.cluster is not None
    cluster = fleet.cluster
    wait_for(
        lambda: all(i.num_running + i.num_waiting == 0 for i in cluster.infos().values()),
        what="both workers idle",
    )
