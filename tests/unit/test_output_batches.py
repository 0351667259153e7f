"""A coordinator stream's batches: every request's outputs in order, a request's pending ones
joined."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.workers.contract.replies import (
    PrefillFacts,
    RequestOutput,
    SequenceFailure,
    WorkerFailed,
)
from kvmesh.workers.output_batches import BatchItem, OutputBatches

FACTS = PrefillFacts(local_tokens=16, host_tokens=0, pulled_tokens=0, computed_tokens=4)


def out(
    rid: str, *tokens: int, finished: bool = False, prefill: PrefillFacts | None = None
) -> RequestOutput:
    return RequestOutput(rid, tokens, finished, "length" if finished else "", prefill)


def batch(items: list[BatchItem]) -> list[BatchItem]:
    """Put `items` (as the engine thread would, before the stream looks), then take once."""

    async def run() -> list[BatchItem]:
        batches = OutputBatches(asyncio.get_running_loop())
        for rid, item in items:
            batches.put(rid, item)
        return await batches.take()

    return asyncio.run(run())


def test_requests_share_a_batch_and_each_ones_pending_outputs_join_in_order() -> None:
    taken = batch(
        [
            ("a", out("a", 5, prefill=FACTS)),
            ("b", out("b", 1)),
            ("a", out("a", 6)),
            ("b", out("b", 2, finished=True)),
            ("a", out("a", 7, 8, finished=True)),
        ]
    )
    assert taken == [
        ("a", RequestOutput("a", (5, 6, 7, 8), True, "length", FACTS)),
        ("b", RequestOutput("b", (1, 2), True, "length", None)),
    ]


def test_failures_and_exceptions_are_never_joined_and_keep_their_place() -> None:
    failed = RequestOutput("a", (), True, "error", None, SequenceFailure("nan logits", True))
    error = WorkerFailed("worker w0 failed")
    taken = batch([("a", out("a", 1)), ("a", failed), ("b", out("b", 3)), ("b", error)])
    assert taken == [("a", out("a", 1)), ("a", failed), ("b", out("b", 3)), ("b", error)]


def test_a_take_waits_for_a_put_from_another_thread_and_leaves_nothing_behind() -> None:
    async def run() -> tuple[list[BatchItem], list[BatchItem]]:
        batches = OutputBatches(asyncio.get_running_loop())
        engine = threading.Timer(0.05, lambda: batches.put("a", out("a", 1)))
        engine.start()
        first = await asyncio.wait_for(batches.take(), timeout=10)
        batches.put("a", out("a", 2, finished=True))  # after the take: a new batch, not joined
        second = await asyncio.wait_for(batches.take(), timeout=10)
        engine.join()
        return first, second

    first, second = asyncio.run(run())
    assert first == [("a", out("a", 1))]
    assert second == [("a", out("a", 2, finished=True))]


def test_joining_refuses_what_cannot_follow() -> None:
    with pytest.raises(ValueError, match="cannot join"):
        out("r", 1, finished=True).then(out("r", 2))
    with pytest.raises(ValueError, match="cannot join"):
        out("r", 1).then(RequestOutput("other", (2,), False))


def test_wait_taken_returns_once_the_loop_took_what_was_put_and_times_out_if_nothing_does() -> None:
    async def run() -> tuple[bool, bool, bool, list[BatchItem]]:
        batches = OutputBatches(asyncio.get_running_loop())
        assert batches.wait_taken(0.0)  # nothing put: nothing to wait for
        batches.put("a", out("a", 1, prefill=FACTS))
        unread = batches.wait_taken(0.02)  # nobody takes on this thread's loop meanwhile
        waited: list[bool] = []
        engine = threading.Thread(target=lambda: waited.append(batches.wait_taken(10)))
        engine.start()
        taken = await asyncio.wait_for(batches.take(), timeout=10)
        await asyncio.to_thread(engine.join, 10)
        return unread, waited == [True], batches.wait_taken(0.0), taken

    unread, woke, empty_after, taken = asyncio.run(run())
    assert not unread
    assert woke
    assert empty_after
    assert taken == [("a", out("a", 1, prefill=FACTS))]
