"""The outputs of every request one coordinator stream sent here, on their way to it as batches.

A worker streams to each coordinator (each `outputs` stream) one Ray message per batch instead of
one per request and token: with 32 sequences decoding, a step's 32 tokens cross as one message.
Per token, a stream per request cost ~200 us of CPU on each side, a shared stream ~20 (a
simulated engine on a CPU, `docs/benchmarks.md`).

    engine thread: put(request_id, output or exception)      -> pending batch
    event loop:    take() -> every pending item, in order     -> one `outputs` message

After a step that finished prefills the engine thread waits (briefly, `wait_taken`) for the
loop to take their first tokens before it goes on to the next step. Otherwise the loop, woken to
send them, waits for the interpreter lock while the engine thread runs the next step's Python:
on an H100 host a local hit's first token sat ~1 ms between `put` and `take` that way.
"""

from __future__ import annotations

import asyncio
import threading

from kvmesh.workers.contract.replies import RequestOutput

__all__ = ["BatchItem", "OutputBatches"]

BatchItem = tuple[str, RequestOutput | Exception]
"""(request id, its next output, or the exception that ends it)."""


class OutputBatches:
    """The engine thread puts (`put`, from any thread); the stream takes (`take`, on the event
    loop the batches were made on).

    An output put while the same request's previous one still waits in the batch is joined to it
    (`RequestOutput.then`): a stream slower than the engine takes a request's tokens of several
    steps as one output instead of falling further behind. Exceptions and failed outputs are never
    joined, nor is anything after a request's finished output.

    Invariants: items leave in the order they were put, per request; an item is taken once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[BatchItem] = []
        self._joinable: dict[str, int] = {}  # request id -> index of its joinable pending output
        self._ready = asyncio.Event()
        self._taken = threading.Condition(self._lock)  # notified when take() empties the batch

    def put(self, request_id: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            at = self._joinable.pop(request_id, None)
            if at is not None and isinstance(item, RequestOutput) and item.failure is None:
                pending = self._items[at][1]
                assert isinstance(pending, RequestOutput)
                joined = pending.then(item)
                self._items[at] = (request_id, joined)
                if joined.joinable:
                    self._joinable[request_id] = at
                return
            self._items.append((request_id, item))
            if isinstance(item, RequestOutput) and item.joinable:
                self._joinable[request_id] = len(self._items) - 1
            wake = len(self._items) == 1
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self) -> list[BatchItem]:
        """Everything put since the last take (waits for at least one item)."""
        while True:
            with self._lock:
                if self._items:
                    items, self._items = self._items, []
                    self._joinable.clear()
                    self._taken.notify_all()
                    return items
            # Cleared on the loop and awaited at once: a put's `set` can only run after this.
            self._ready.clear()
            await self._ready.wait()

    def wait_taken(self, timeout_s: float) -> bool:
        """Block the calling thread (never the loop's) until everything put so far has been
        taken, at most `timeout_s`; whether it was."""
        with self._taken:
            return self._taken.wait_for(lambda: not self._items, timeout_s)
