"""The request path in process: the real Coordinator over a fake worker backend, a real mirror
and registry, and an injected clock (no Ray, no gRPC, no torch in the coordinator)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import cast

import pytest

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.contract import InvalidRequest, NoLiveWorker, WorkerDied
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.links import LinkTable, LinkType
from kvmesh.coordinator.routing.transfer_planner import TransferPlanner
from kvmesh.proto.events import BlockStored, EventBatch
from kvmesh.workers.contract.replies import (
    PrefillFacts,
    RequestOutput,
    WorkerCounters,
    WorkerInfo,
)
from kvmesh.workers.contract.requests import SamplingConfig, Transport, WorkerRequest
from kvmesh.workers.model.model_config import preset

BS = 16
MODEL = preset("tiny-random")


class FakeBackend:
    """Answers every request with `max_tokens` tokens; the first output carries facts that say
    the pulled run arrived (and that the request took 2 ms to reach the engine). `die` names
    workers that fail after their first token. `requests`: those read (that ran); `sent`: every
    `send`; `aborted`: sent ones closed unfinished."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, WorkerRequest]] = []
        self.die: set[str] = set()
        self.sent: list[tuple[str, str]] = []
        self.aborted: list[tuple[str, str]] = []

    def send(self, worker_id: str, request: WorkerRequest) -> Generator[RequestOutput, None, None]:
        self.sent.append((worker_id, request.request_id))
        stream = self._sent(worker_id, request)
        next(stream)  # sent now: closing it, read or not, aborts it
        return cast(Generator[RequestOutput, None, None], stream)

    def _sent(
        self, worker_id: str, request: WorkerRequest
    ) -> Generator[RequestOutput | None, None, None]:
        finished = False
        try:
            yield None
            for out in self.generate(worker_id, request):
                finished = out.finished
                yield out
        except GeneratorExit:
            if not finished:
                self.aborted.append((worker_id, request.request_id))
            raise

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        self.requests.append((worker_id, request))
        n = len(request.prompt_ids)
        pulled = BS * len(request.pull.hashes) if request.pull is not None else 0
        facts = PrefillFacts(
            0, 0, pulled, n - pulled, pull_ms=1.0, pull_bytes=pulled * 64, dispatch_ms=2.0
        )
        for k in range(request.sampling.max_tokens):
            last = k == request.sampling.max_tokens - 1
            yield RequestOutput(
                request.request_id,
                (100 + k,),
                last,
                "length" if last else "",
                facts if k == 0 else None,
            )
            if worker_id in self.die:
                raise WorkerDied(worker_id)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def info(worker_id: str, device: str = "cpu") -> WorkerInfo:
    return WorkerInfo(
        worker_id, 1, "node", device, "m", BS, 1000, 1000, 0, 0, 0, 1, WorkerCounters()
    )


def make(workers: tuple[str, ...] = ("w0", "w1"), *, transfers: bool = False):  # type: ignore[no-untyped-def]
    backend, mirror, registry = FakeBackend(), LockedMirror(), WorkerRegistry()
    for w in workers:
        registry.add(w)
        mirror.load_worker(WorkerId(w), 1, 0, [])
    planner = None
    if transfers:
        links = LinkTable()
        links.set(LinkType.SAME_NODE, 1e9, 0.01)  # a fast link: pulling beats recomputing
        planner = TransferPlanner(info, 64, BS, links)
    # A decision log a test sets commits before the request is sent (test_speculative_send.py
    # covers sending while the commit travels).
    config = CoordinatorConfig(block_size=BS, policy="kvmesh", speculative_dispatch=False)
    coordinator = Coordinator(
        config, MODEL, backend, mirror, registry, transfers=planner, clock=Clock()
    )
    registry.on_dead(coordinator.forget_worker)
    registry.on_dead(lambda w: mirror.remove_worker(WorkerId(w)))
    return coordinator, backend, mirror, registry


def hold(mirror: LockedMirror, worker: str, hashes: tuple) -> None:  # type: ignore[type-arg]
    """The worker's next event batch stores `hashes` (seq follows the worker's cursor)."""
    cursor = mirror.cursor(WorkerId(worker))
    seq = cursor[1] + 1 if cursor is not None else 1
    assert mirror.apply(EventBatch(worker, 1, seq, (BlockStored(tuple(hashes)),))).name == "APPLIED"


PROMPT = [(i * 7) % 250 + 3 for i in range(1024 + 5)]


def test_a_request_goes_to_the_worker_whose_cache_holds_its_prefix() -> None:
    c, backend, mirror, _ = make()
    prompt = c.prompts.prepare(PROMPT, "", "")
    hold(mirror, "w1", prompt.block_hashes[:32])
    events = list(c.generate(prompt, SamplingConfig(max_tokens=3)))
    assert {e.worker_id for e in events} == {"w1"}
    assert [t for e in events for t in e.token_ids] == [100, 101, 102]
    assert events[0].prefill is not None and events[-1].finished
    stats = c.stats()
    assert stats["num_requests"] == 1 and stats["generated_tokens"] == 3
    assert stats["prompt_tokens"] == len(PROMPT)
    c.fleet.check_invariants()
    c.counters.check_invariants()


def test_a_pull_plan_travels_to_the_worker_with_the_exact_run_to_move() -> None:
    c, backend, mirror, _ = make(transfers=True)
    prompt = c.prompts.prepare(PROMPT, "", "")
    hold(mirror, "w0", prompt.block_hashes[:64])  # w0 holds the whole prefix
    hold(mirror, "w1", prompt.block_hashes[:8])  # w1 only its start
    events = list(c.generate(prompt, SamplingConfig(max_tokens=1), worker_id="w1"))
    worker, request = backend.requests[-1]
    assert worker == "w1" and request.pull is not None
    assert request.pull.source == "w0" and request.pull.from_block == 8
    assert request.pull.hashes == prompt.block_hashes[8:64]
    assert request.pull.transport is Transport.OBJECT_STORE
    assert events[0].prefill is not None and events[0].prefill.pulled_tokens == 56 * BS
    assert c.stats()["pulled_tokens"] == 56 * BS
    assert c.transfers is not None and c.transfers.num_pulls == 1


def test_a_pull_never_asks_for_the_block_of_the_last_prompt_token() -> None:
    c, backend, mirror, _ = make(transfers=True)
    exact = PROMPT[: 64 * BS]  # 64 full blocks: the last holds the last prompt token
    prompt = c.prompts.prepare(exact, "", "")
    hold(mirror, "w0", prompt.block_hashes)
    list(c.generate(prompt, SamplingConfig(max_tokens=1), worker_id="w1"))
    _, request = backend.requests[-1]
    assert request.pull is not None and request.pull.hashes == prompt.block_hashes[:63]


def test_the_router_sees_the_callers_max_tokens_and_none_for_a_server_default() -> None:
    c, _, _, _ = make()
    seen: list[int | None] = []
    choose = c.policy.choose
    c.policy.choose = lambda q, ws: (seen.append(q.max_tokens), choose(q, ws))[1]  # type: ignore[method-assign]
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    list(c.generate(prompt, SamplingConfig(max_tokens=3)))
    list(c.generate(prompt, SamplingConfig(max_tokens=5), max_tokens_known=False))
    c.route(prompt, max_tokens=7)
    c.route(prompt)
    assert seen == [3, None, 7, None]


def test_a_stream_whose_worker_dies_continues_on_another() -> None:
    c, backend, _, registry = make()
    backend.die.add("w0")
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    events = list(c.generate(prompt, SamplingConfig(max_tokens=4), worker_id="w0"))
    assert [e.worker_id for e in events][0] == "w0" and events[-1].worker_id == "w1"
    assert len([t for e in events for t in e.token_ids]) == 4
    assert c.stats()["num_migrations"] == 1
    _, moved = backend.requests[-1]
    assert moved.prompt_ids == prompt.token_ids + (100,)  # prompt + what was already streamed


def test_a_migration_never_goes_back_to_a_worker_that_died_under_it() -> None:
    # The registry has not heard of w0's death yet and w0 holds the prompt: the router's
    # favourite, but the stream saw it die.
    c, backend, mirror, _ = make()
    backend.die.add("w0")
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    hold(mirror, "w0", prompt.block_hashes)
    events = list(c.generate(prompt, SamplingConfig(max_tokens=4), worker_id="w0"))
    assert [w for w, _ in backend.requests] == ["w0", "w1"]
    assert len([t for e in events for t in e.token_ids]) == 4
    assert c.stats()["num_migrations"] == 1


def test_a_migration_with_every_live_worker_dead_under_it_is_unavailable() -> None:
    c, backend, _, _ = make()
    backend.die.update(("w0", "w1"))
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    with pytest.raises(NoLiveWorker):
        list(c.generate(prompt, SamplingConfig(max_tokens=4), worker_id="w0"))
    assert [w for w, _ in backend.requests] == ["w0", "w1"]
    assert c.stats()["num_failed_requests"] == 1


def test_routing_follows_the_registry_drained_and_dead_workers_get_nothing() -> None:
    c, backend, mirror, registry = make(("w0", "w1", "w2"))
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    hold(mirror, "w2", prompt.block_hashes[:2])
    registry.set_drained("w2", True)
    registry.mark_dead("w1", "test")
    assert mirror.num_worker_blocks(WorkerId("w1")) == 0
    for _ in range(4):
        list(c.generate(prompt, SamplingConfig(max_tokens=1)))
    assert {w for w, _ in backend.requests} == {"w0"}
    with pytest.raises(NoLiveWorker):
        list(c.generate(prompt, SamplingConfig(max_tokens=1), worker_id="w1"))
    registry.mark_dead("w0", "test")
    with pytest.raises(NoLiveWorker):
        c.route(prompt)
    registry.check_invariants()


def test_bad_requests_are_refused_before_anything_is_routed() -> None:
    c, backend, _, _ = make()
    with pytest.raises(InvalidRequest):
        c.prompts.prepare([MODEL.vocab_size], "", "")
    prompt = c.prompts.prepare([1, 2, 3], "", "")
    with pytest.raises(InvalidRequest):
        c.generate(prompt, SamplingConfig(max_tokens=1), worker_id="nope")
    assert backend.requests == []


def test_the_registry_fans_a_death_out_once_and_never_revives_it() -> None:
    registry = WorkerRegistry()
    seen: list[str] = []
    registry.on_dead(seen.append)
    registry.add("w0")
    assert registry.mark_dead("w0", "test") and not registry.mark_dead("w0", "again")
    assert seen == ["w0"] and registry.alive() == []
    with pytest.raises(ValueError, match="dead"):
        registry.set_drained("w0", True)
    with pytest.raises(ValueError, match="unknown"):
        registry.set_drained("w9", True)
    registry.check_invariants()


class Records:
    """A request observer keeping the records it is told of."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def on_routed(self, seconds: float) -> None:
        pass

    def on_request_done(self, record) -> None:  # type: ignore[no-untyped-def]
        self.outcomes.append(record.outcome)


def observed_stream(max_tokens: int):  # type: ignore[no-untyped-def]
    """A coordinator whose request records are kept, and one request's stream on it."""
    c, _, _, _ = make()
    records = Records()
    c.observers = (records,)
    prompt = c.prompts.prepare(PROMPT[:40], "", "")
    return c, records, c.generate(prompt, SamplingConfig(max_tokens=max_tokens))


def test_a_stream_closed_once_its_final_event_is_read_finished_and_was_not_cancelled() -> None:
    # The OpenAI front door stops reading at the final event and closes the stream.
    c, records, events = observed_stream(3)
    for event in events:
        if event.finished:
            break
    events.close()
    assert c.stats()["num_cancelled_requests"] == 0
    assert records.outcomes == ["ok"]


def test_a_stream_closed_before_its_final_event_was_cancelled() -> None:
    c, records, events = observed_stream(3)
    first = next(events)
    assert not first.finished
    events.close()
    assert c.stats()["num_cancelled_requests"] == 1
    assert records.outcomes == ["cancelled"]


def test_a_stream_its_consumer_ends_early_as_done_finished_and_was_not_cancelled() -> None:
    # A stop string: the consumer has its answer before the worker's last token.
    c, records, events = observed_stream(5)
    first = next(events)
    assert not first.finished
    with pytest.raises(StopIteration):
        events.send(True)
    assert c.stats()["num_cancelled_requests"] == 0
    assert c.stats()["num_failed_requests"] == 0
    assert records.outcomes == ["ok"]
