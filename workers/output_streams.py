"""The output streams open on a worker, and which one each request's outputs go to.

outputs(stream_id)  -> open: a stream's batches (`OutputBatches`)
submit(request)     -> route: request id -> the stream its `reply_to` names (must be open)
engine thread       -> deliver: into the request's stream; its end unroutes it
                       wait_taken: until the streams of some requests took what they got
stream closed       -> close: its requests unrouted and returned, for the worker to abort
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from kvmesh.workers.contract.replies import RequestOutput, RequestRejected
from kvmesh.workers.output_batches import OutputBatches

__all__ = ["OutputStreams"]


class OutputStreams:
    """Called from the event loop (open, close, route) and the engine thread (deliver).

    Invariants: a routed request's stream is open; a stream's close unroutes its requests; a
    request's end (finished or failed output, or an exception) unroutes it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, OutputBatches] = {}
        self._routes: dict[str, OutputBatches] = {}

    def open(self, stream_id: str, loop: asyncio.AbstractEventLoop) -> OutputBatches:
        with self._lock:
            if stream_id in self._open:
                raise ValueError(f"output stream {stream_id!r} is already open")
            batches = self._open[stream_id] = OutputBatches(loop)
            return batches

    def close(self, stream_id: str) -> list[str]:
        """Close a stream; returns the requests that were still routed to it."""
        with self._lock:
            batches = self._open.pop(stream_id, None)
            orphans = [rid for rid, b in self._routes.items() if b is batches]
            for rid in orphans:
                del self._routes[rid]
            return orphans

    def route(self, request_id: str, stream_id: str) -> None:
        with self._lock:
            batches = self._open.get(stream_id)
            if batches is None:
                raise RequestRejected(f"no output stream {stream_id!r} is open here")
            self._routes[request_id] = batches

    def unroute(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def routed(self) -> list[str]:
        with self._lock:
            return list(self._routes)

    def deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        """Into the request's stream (nothing if it is not routed: aborted, or its stream
        closed); an end unroutes it."""
        with self._lock:
            batches = self._routes.get(request_id)
            if isinstance(item, Exception) or item.finished:  # a failure is finished too
                self._routes.pop(request_id, None)
        if batches is not None:
            batches.put(request_id, item)

    def wait_taken(self, request_ids: Sequence[str], timeout_s: float) -> bool:
        """Block the calling thread until the streams of `request_ids` have taken everything
        delivered to them, at most `timeout_s` in all; whether they did (requests no longer
        routed are not waited for)."""
        with self._lock:
            streams = {id(b): b for rid in request_ids if (b := self._routes.get(rid)) is not None}
        deadline = time.monotonic() + timeout_s
        return all(b.wait_taken(max(0.0, deadline - time.monotonic())) for b in streams.values())
