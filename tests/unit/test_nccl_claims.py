"""The NCCL transport's claims: a worker is in one transfer at a time, waits without holding a
claim, and gives up (object-store fallback) when the peer stays busy. No GPU needed: the peer is
a stand-in with the actor's call shape."""

from __future__ import annotations

import asyncio
from typing import Any

from kvmesh.workers.transfer.nccl import NcclLink, NcclTransport


class Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class PeerStandIn:
    """`nccl_accept` as the actor answers it: None while the peer's link is claimed."""

    def __init__(self, link: NcclLink) -> None:
        self.link = link

        async def accept(hashes: list[int]) -> list[int] | None:
            if not link.try_claim():
                return None
            return list(range(len(hashes)))

        self.nccl_accept = Method(accept)


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
