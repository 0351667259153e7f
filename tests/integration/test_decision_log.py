"""The decision log against a real Redis (no Ray): two coordinator replicas committing
conflicting decisions end with the same ordered log applied, and the same policy state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvmesh.coordinator.cluster.redis_server import RedisServer, start_redis_server
from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.decision_stream import DecisionStream
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.placements import decode_placement
from kvmesh.workers.contract.replies import PrefillFacts, RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.model.model_config import preset

pytestmark = [pytest.mark.redis]

BS = 16
WORKERS = ("w0", "w1", "w2")
PROMPT = [(i * 7) % 250 + 3 for i in range(512 + 5)]


@pytest.fixture
def url() -> Iterator[str]:
    server: RedisServer = start_redis_server()
    yield server.url
    server.stop()


class Backend:
    """Takes every request and answers nothing until told: requests stay in flight."""

    def __init__(self) -> None:
        self.placed: list[tuple[str, str]] = []

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        self.placed.append((request.request_id, worker_id))
        facts = PrefillFacts(0, 0, 0, len(request.prompt_ids))
        yield RequestOutput(request.request_id, (1,), True, "length", facts)


def replica(url: str) -> tuple[Coordinator, DecisionStream]:
    registry, mirror = WorkerRegistry(), LockedMirror()
    for w in WORKERS:
        registry.add(w)
        mirror.load_worker(WorkerId(w), 1, 0, [])
    stream = DecisionStream(IndexStore(url))
    config = CoordinatorConfig(
        block_size=BS, policy="kvmesh", decision_log=True, speculative_dispatch=False
    )
    coordinator = Coordinator(
        config,
        preset("tiny-random"),
        Backend(),
        mirror,
        registry,
        decision_log=stream,
        clock=lambda: 100.0,  # one instant: the recent-load decay is the same on both
    )
    stream.on_entries = coordinator.decisions.observe
    stream.on_jump = coordinator.decisions.skip_to
    return coordinator, stream


def test_conflicting_replicas_end_with_the_same_ordered_state(url: str) -> None:
    a, stream_a = replica(url)
    b, stream_b = replica(url)
    sampling = SamplingConfig(max_tokens=1)
    # Neither follows the stream yet: each decides on what it applied, so b's first commit
    # (expecting an empty log) loses to a's, and a's second loses to b's, and so on.
    streams = []
    for k in range(6):
        c = a if k % 2 == 0 else b
        prompt = c.prompts.prepare(PROMPT[: 100 + 60 * k], "", "")
        streams.append(c.generate(prompt, sampling, session_id=f"s{k % 3}", request_id=f"r{k}"))
    assert IndexStore(url).decision_seq() == 6
    lost = [c.counters.num_commit_attempts - c.counters.num_commits for c in (a, b)]
    assert lost == [2, 3]  # every decision after the first saw the other's last one too late
    # Both now follow the stream: each applies what it has not yet, in order.
    while stream_a.poll_once(block_ms=None) or stream_b.poll_once(block_ms=None):
        pass
    assert a.decisions.cursor.applied_seq == b.decisions.cursor.applied_seq == 6
    assert a.decisions.cursor.num_skipped == b.decisions.cursor.num_skipped == 0
    assert _state(a) == _state(b)
    # The log in Redis: one entry per decision, in commit order, each with its decider.
    client = redis.Redis.from_url(url)
    entries = client.xrange(schema.DECISIONS_STREAM)
    assert [e[0] for e in entries] == [f"{s}-0".encode() for s in range(1, 7)]
    decided = [decode_placement(e[1][b"d"]) for e in entries]
    assert [p.request_id for p in decided] == [f"r{k}" for k in range(6)]
    assert [p.origin for p in decided] == [a.origin, b.origin] * 3
    for s in streams:
        list(s)


def test_a_replica_starts_at_the_end_of_the_log(url: str) -> None:
    a, _ = replica(url)
    prompt = a.prompts.prepare(PROMPT, "", "")
    list(a.generate(prompt, SamplingConfig(max_tokens=1), request_id="r0"))
    late, stream = replica(url)
    stream.on_jump(IndexStore(url).decision_seq())
    assert late.decisions.cursor.applied_seq == 1
    assert stream.poll_once(block_ms=None) == 1  # the stream re-reads from 0; applied once
    assert late.decisions.cursor.applied_seq == 1


def _state(c: Coordinator) -> tuple:  # type: ignore[type-arg]
    policy = c.policy
    ids = [WorkerId(w) for w in WORKERS]
    work, requests = policy._recent.snapshot(ids, c.clock())  # type: ignore[attr-defined]
    running = policy._running.tokens_many(ids).tolist()  # type: ignore[attr-defined]
    hashes = c.prompts.prepare(PROMPT, "", "").block_hashes
    routed = [policy._routed.extend(w, hashes, 0) for w in ids]  # type: ignore[attr-defined]
    sessions = [policy._sessions.get(f"s{k}") for k in range(3)]  # type: ignore[attr-defined]
    return work, requests, running, routed, sessions
