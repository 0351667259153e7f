"""The puller on real CPU workers, the source asked before the target reserves (as the actor does
it): a pull lands and the request is queued in the same engine call; a request whose plan did not
fit still has its writer run over nothing of its own; a failed fetch means recompute."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.contract.requests import PullSpec
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.transfer.block_export import BlockExport
from kvmesh.workers.transfer.puller import Puller
from tests.unit.test_transfer import PREFIX, chain_of, finish, make_worker, request, warm_peer

T = TypeVar("T")


class ManualClock:
    """Seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class SourceStandIn:
    """A peer as a transport calls it (`PeerSource`'s shape), in process; `fail` makes the
    export raise, as a peer that died would; `answer_after_s` moves `clock` on while it answers."""

    def __init__(
        self,
        worker: Worker,
        fail: bool = False,
        answer_after_s: float = 0.0,
        clock: ManualClock | None = None,
    ) -> None:
        self.worker = worker
        self.fail = fail
        self.answer_after_s = answer_after_s
        self.clock = clock or ManualClock()
        self.asked: list[int] = []

    async def export(self, hashes: Sequence[BlockHash]) -> BlockExport:
        self.asked.append(len(hashes))
        self.clock.now_s += self.answer_after_s
        if self.fail:
            raise ConnectionError("peer went away")
        return self.worker.pull_source.export_blocks(hashes)

    def close(self) -> None:
        pass


def puller_for(target: Worker, source: SourceStandIn) -> tuple[Puller, list[tuple[str, str]]]:
    failures: list[tuple[str, str]] = []

    async def on_engine(fn: Callable[[], T]) -> T:
        return fn()  # one thread here: the "engine" is the event loop's

    puller = Puller(
        target,
        "node",
        on_engine,
        lambda rid, exc: failures.append((rid, str(exc))),
        clock=source.clock,
    )
    puller._peers["peer"] = source  # type: ignore[assignment]
    return puller, failures


def submit(target: Worker, puller: Puller, rid: str, prompt: list[int], spec: PullSpec) -> Any:
    """What the actor's submit does: begin the pull, reserve, hand the reservation over."""

    async def scenario() -> None:
        reserved = puller.begin(rid, spec)
        reserved.set_result(target.add_request(request(rid, prompt, pull=spec)))
        while puller._tasks:
            await asyncio.sleep(0)

    asyncio.run(scenario())


def test_a_pull_begun_before_the_reservation_lands_and_queues_the_request() -> None:
    peer = SourceStandIn(warm_peer())
    target, logits = make_worker("target")
    puller, failures = puller_for(target, peer)
    prompt = PREFIX + [7, 7]
    spec = PullSpec("peer", 0, tuple(chain_of(target, prompt)[:6]))
    submit(target, puller, "req", prompt, spec)
    assert peer.asked == [6] and failures == []
    assert target.has_work  # queued by the same call that wrote the blocks
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None and (facts.pulled_tokens, facts.computed_tokens) == (96, 2)
    target.check_invariants()


def test_a_pull_reports_where_its_time_went() -> None:
    peer = SourceStandIn(warm_peer(), answer_after_s=0.03)
    target, _ = make_worker("target")
    puller, _ = puller_for(target, peer)
    prompt = PREFIX + [7, 7]
    submit(target, puller, "req", prompt, PullSpec("peer", 0, tuple(chain_of(target, prompt)[:6])))
    facts = finish(target, "req")[0].prefill
    assert facts is not None and facts.pulled_tokens == 96
    # the source's slow answer is the source's share; writing took no time of this clock
    assert facts.pull_source_ms == pytest.approx(30.0)
    assert (facts.pull_write_ms, facts.pull_ms) == (0.0, pytest.approx(30.0))


def test_a_plan_that_did_not_fit_runs_the_writer_over_nothing_of_its_own() -> None:
    peer = SourceStandIn(warm_peer())
    target, _ = make_worker("target")
    puller, failures = puller_for(target, peer)
    prompt = PREFIX + [7, 7]
    wrong = tuple(BlockHash(h + 1) for h in chain_of(target, prompt)[:6])
    submit(target, puller, "req", prompt, PullSpec("peer", 0, wrong))
    assert peer.asked == [6] and failures == []  # the source was asked all the same
    outs = finish(target, "req")
    assert outs[0].prefill is not None and outs[0].prefill.computed_tokens == 98
    assert target.pool.num_free == target.pool.num_blocks
    target.check_invariants()


def test_a_failed_fetch_means_recompute() -> None:
    peer = SourceStandIn(warm_peer(), fail=True)
    target, _ = make_worker("target")
    puller, failures = puller_for(target, peer)
    prompt = PREFIX + [7, 7]
    spec = PullSpec("peer", 0, tuple(chain_of(target, prompt)[:6]))
    submit(target, puller, "req", prompt, spec)
    assert failures == []  # a failed pull is not a failed request
    outs = finish(target, "req")
    facts = outs[0].prefill
    assert facts is not None and (facts.pulled_tokens, facts.computed_tokens) == (0, 98)
    assert target.tally.num_failed_pulls == 1
    target.check_invariants()
