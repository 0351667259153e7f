"""Which output stream a request's outputs go to on a worker (`OutputStreams`)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.workers.contract.replies import RequestOutput, RequestRejected, WorkerFailed
from kvmesh.workers.output_batches import OutputBatches
from kvmesh.workers.output_streams import OutputStreams


def two_streams() -> tuple[OutputStreams, OutputBatches, OutputBatches]:
    """Streams coord-a (request r1's) and coord-b (r2's), on the running loop."""
    streams = OutputStreams()
    loop = asyncio.get_running_loop()
    a, b = streams.open("coord-a", loop), streams.open("coord-b", loop)
    streams.route("r1", "coord-a")
    streams.route("r2", "coord-b")
    return streams, a, b


def test_outputs_reach_their_requests_stream_until_the_request_ends() -> None:
    async def run() -> tuple[list[object], list[object]]:
        streams, a, b = two_streams()
        streams.deliver("r1", RequestOutput("r1", (1,), False))
        streams.deliver("r2", RequestOutput("r2", (2,), True, "length"))
        streams.deliver("r2", RequestOutput("r2", (3,), False))  # after its end: dropped
        streams.deliver("r1", WorkerFailed("worker w0 failed"))
        assert streams.routed() == []  # both ended
        return await a.take(), await b.take()

    got_a, got_b = asyncio.run(run())
    assert got_a[0] == ("r1", RequestOutput("r1", (1,), False))
    assert got_a[1][0] == "r1" and isinstance(got_a[1][1], WorkerFailed)
    assert got_b == [("r2", RequestOutput("r2", (2,), True, "length"))]


def test_a_closed_stream_hands_back_its_requests_and_takes_no_more() -> None:
    async def run() -> None:
        streams = OutputStreams()
        loop = asyncio.get_running_loop()
        streams.open("coord-a", loop)
        streams.open("coord-b", loop)
        streams.route("r1", "coord-a")
        streams.route("r2", "coord-a")
        streams.route("r3", "coord-b")
        assert sorted(streams.close("coord-a")) == ["r1", "r2"]
        assert streams.routed() == ["r3"]
        with pytest.raises(RequestRejected, match="no output stream"):
            streams.route("r4", "coord-a")
        with pytest.raises(ValueError, match="already open"):
            streams.open("coord-b", loop)
        streams.unroute("r3")
        assert streams.routed() == []

    asyncio.run(run())


def test_wait_taken_waits_for_the_streams_of_the_named_requests_only() -> None:
    async def run() -> tuple[bool, bool, bool]:
        streams, a, b = two_streams()
        streams.deliver("r1", RequestOutput("r1", (1,), False))
        streams.deliver("r2", RequestOutput("r2", (2,), False))
        await a.take()  # coord-a took r1's output; coord-b has not taken r2's
        only_r1 = streams.wait_taken(["r1", "gone"], 0.0)  # an unrouted id is not waited for
        with_r2 = streams.wait_taken(["r1", "r2"], 0.02)
        await b.take()
        return only_r1, with_r2, streams.wait_taken(["r1", "r2"], 0.0)

    only_r1, with_r2, after = asyncio.run(run())
    assert only_r1
    assert not with_r2
    assert after
