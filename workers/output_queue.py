"""One request's outputs on their way from the engine thread to the request's stream."""

from __future__ import annotations

import asyncio

from kvmesh.workers.contract.replies import RequestOutput

__all__ = ["OutputQueue"]


class OutputQueue:
    """The engine thread puts (`put`, from any thread); the request's stream takes (`take`, on
    the event loop the queue was made on).

    What the engine queued while the stream was busy handing the last output over comes out as
    one output (`RequestOutput.then`): a consumer slower than the engine takes a step's worth of
    tokens per item instead of falling further behind one item per step. An exception (the worker
    failed) or a failed output ends such a run and comes out next, on its own; a finished output
    ends it too (nothing follows it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._held: RequestOutput | Exception | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def take(self) -> RequestOutput:
        """The next output, joined with those queued behind it; raises a queued exception."""
        item = self._held if self._held is not None else await self._items.get()
        self._held = None
        if isinstance(item, Exception):
            raise item
        while not item.finished and item.failure is None and not self._items.empty():
            later = self._items.get_nowait()
            if isinstance(later, Exception) or later.failure is not None:
                self._held = later
                break
            item = item.then(later)
        return item
