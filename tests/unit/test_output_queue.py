"""A request's output queue: outputs queued while the stream was busy come out as one."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.workers.contract.replies import (
    PrefillFacts,
    RequestOutput,
    SequenceFailure,
    WorkerFailed,
)
from kvmesh.workers.output_queue import OutputQueue

FACTS = PrefillFacts(local_tokens=16, host_tokens=0, pulled_tokens=0, computed_tokens=4)


def out(*tokens: int, finished: bool = False, prefill: PrefillFacts | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, finished, "length" if finished else "", prefill)


def drain(items: list[RequestOutput | Exception], takes: int) -> list[object]:
    """Queue `items` (as the engine thread would, before the stream looks), then take."""

    async def run() -> list[object]:
        q = OutputQueue(asyncio.get_running_loop())
        for item in items:
            q.put(item)
        await asyncio.sleep(0)  # let the thread-safe puts land
        taken: list[object] = []
        for _ in range(takes):
            try:
                taken.append(await q.take())
            except WorkerFailed as exc:
                taken.append(exc)
        return taken

    return asyncio.run(run())


def test_outputs_queued_behind_one_come_out_joined_in_order() -> None:
    (joined,) = drain([out(5, prefill=FACTS), out(6), out(7, 8, finished=True)], takes=1)
    assert joined == RequestOutput("r", (5, 6, 7, 8), True, "length", FACTS)


def test_a_finished_output_ends_the_join_and_a_failure_comes_out_on_its_own() -> None:
    failed = RequestOutput("r", (), True, "error", None, SequenceFailure("nan logits", True))
    first, second = drain([out(1), out(2), failed], takes=2)
    assert first == out(1, 2)
    assert second is failed
    error = WorkerFailed("worker w0 failed")
    first, second = drain([out(3), out(4), error], takes=2)
    assert first == out(3, 4) and second is error


def test_an_output_taken_alone_is_unchanged() -> None:
    (only,) = drain([out(9, prefill=FACTS)], takes=1)
    assert only == out(9, prefill=FACTS)


def test_joining_refuses_what_cannot_follow() -> None:
    with pytest.raises(ValueError, match="cannot join"):
        out(1, finished=True).then(out(2))
    with pytest.raises(ValueError, match="cannot join"):
        out(1).then(RequestOutput("other", (2,), False))
