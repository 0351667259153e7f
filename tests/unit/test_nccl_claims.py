"""The NCCL transport's claims: a worker is in one transfer at a time, waits without holding a
claim, and gives up (object-store fallback) when the peer stays busy. No GPU needed: the peer is
a stand-in with the actor's call shape. Also: which group a coordinator that did not form it
adopts, and how a run is split into the layer groups that pipeline the wire with the prefill."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvmesh.coordinator.cluster.cluster import agreed_nccl_group
from kvmesh.workers.kv.layer_writes import group_spans
from kvmesh.workers.transfer.nccl import PIPELINE_CHUNKS, NcclLink, NcclTransport, serve_send


class PeerStandIn:
    """`nccl_accept` as a pull source answers it: None while the peer's link is claimed."""

    def __init__(self, link: NcclLink) -> None:
        self.link = link

    async def nccl_accept(self, hashes: list[int], dst_rank: int) -> list[int] | None:
        if not self.link.try_claim():
            return None
        return list(range(len(hashes)))


def transport(wait_s: float) -> tuple[NcclTransport, NcclLink, NcclLink]:
    ours, theirs = NcclLink(0, {"a": 0, "b": 1}), NcclLink(1, {"a": 0, "b": 1})
    peer = PeerStandIn(theirs)
    t = NcclTransport(lambda _w: peer, None, ours, claim_wait_s=wait_s, retry_s=0.001)  # type: ignore[arg-type]
    return t, ours, theirs


def test_a_claim_waits_for_a_busy_peer_without_holding_its_own() -> None:
    t, ours, theirs = transport(wait_s=1.0)
    theirs.busy = True
    seen_ours_free = []

    async def scenario() -> list[int] | None:
        async def free_later() -> None:
            await asyncio.sleep(0.02)
            seen_ours_free.append(not ours.busy)  # waiting, we hold nothing
            theirs.release()

        releaser = asyncio.create_task(free_later())
        ids = await t._claim_both("b", (1, 2, 3))  # type: ignore[arg-type]
        await releaser
        return ids

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert seen_ours_free == [True]
    assert ours.busy and theirs.busy  # both claimed for the transfer


def test_a_peer_that_stays_busy_means_fallback_with_no_claim_left() -> None:
    t, ours, theirs = transport(wait_s=0.01)
    theirs.busy = True
    assert asyncio.run(t._claim_both("b", (1,))) is None  # type: ignore[arg-type]
    assert not ours.busy and theirs.busy


def test_an_attached_coordinator_adopts_the_group_most_live_workers_share() -> None:
    group = {"w0": 0, "w1": 1, "w2": 2}
    reports = {"w0": group, "w1": group, "w2": group, "w3": {}}  # w3 replaced a dead worker
    assert agreed_nccl_group(reports) == group
    # w2 died and is gone from the reports: the survivors still share the group.
    assert agreed_nccl_group({"w0": group, "w1": group}) == {"w0": 0, "w1": 1}
    # A worker that claims a group without itself in it, or a lone member, forms none.
    assert agreed_nccl_group({"w0": {"w1": 0}, "w1": {}}) == {}
    assert agreed_nccl_group({"w0": group, "w1": {}}) == {}
    assert agreed_nccl_group({}) == {}
    # Two groups (a re-formed fleet beside stale members): the larger wins, members only.
    new = {"w3": 0, "w4": 1, "w5": 2}
    mixed = {"w0": {"w0": 0, "w1": 1}, "w1": {"w0": 0, "w1": 1}, "w3": new, "w4": new, "w5": new}
    assert agreed_nccl_group(mixed) == new


class LandedLater:
    """A CUDA event's `query` as the send's `done` answers it: False `polls` times, then True."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


class SendingLink(NcclLink):
    """A link whose `send` hands back a transfer that lands after a few polls, or fails."""

    def __init__(self, fail: bool) -> None:
        super().__init__(0, {"a": 0, "b": 1})
        self.fail = fail
        self.sent: list[tuple[list[int], int]] = []

    def send(self, cache: Any, ids: list[int], dst_rank: int) -> Any:
        if self.fail:
            raise RuntimeError("NCCL error")
        self.sent.append((ids, dst_rank))
        return SimpleNamespace(done=LandedLater(polls=3), staging=[])


@pytest.mark.parametrize("fail", [False, True])
def test_the_source_unpins_and_lets_go_once_its_send_has_landed_or_failed(fail: bool) -> None:
    link = SendingLink(fail)
    assert link.try_claim()
    engine_calls: list[str] = []
    unpinned: list[bool] = []

    async def on_engine(fn: Any) -> Any:
        engine_calls.append(getattr(fn, "__name__", "?"))
        return fn()

    def unpin() -> None:
        unpinned.append(link.busy)  # still claimed while the run is unpinned

    asyncio.run(serve_send(link, None, [4, 5, 6], 1, on_engine, unpin))
    assert link.sent == ([] if fail else [([4, 5, 6], 1)])
    assert unpinned == [True] and not link.busy
    assert engine_calls[-1] == "unpin"  # the pool is the engine thread's


@pytest.mark.parametrize("num_layers", [0, 1, 3, 7, 8, 9, 32, 80])
def test_layer_groups_cover_every_layer_once_in_order(num_layers: int) -> None:
    spans = group_spans(num_layers, PIPELINE_CHUNKS)
    assert len(spans) == min(PIPELINE_CHUNKS, num_layers)
    covered = [layer for lo, hi in spans for layer in range(lo, hi)]
    assert covered == list(range(num_layers))
    sizes = [hi - lo for lo, hi in spans]
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_layer_groups_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="-1 layers"):
        group_spans(-1, 4)
    with pytest.raises(ValueError, match="in 0 groups"):
        group_spans(4, 0)
