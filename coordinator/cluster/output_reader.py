"""One worker's output stream to this coordinator, split back into its requests.

A thread reads the worker's `outputs` stream (a batch of outputs per message, every request this
coordinator submitted there; the first batch, empty, says the stream is open) and hands each
output to the queue of the request's caller:

    worker --outputs(stream_id)--> reader thread --> queue per request --> Cluster.generate

When the stream breaks (the worker's actor died or was killed), every request still waiting gets
`WORKER_DIED` and the reader is done; the next request to that worker opens a new one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import ray
from ray.exceptions import RayActorError, RayError

from kvmesh.workers.contract.replies import RequestOutput

log = logging.getLogger(__name__)

WORKER_DIED: Final = "worker died"
"""What a request's queue gets when its worker's stream broke."""

Delivery: TypeAlias = RequestOutput | Exception | str


class OutputReader:
    """Invariants: a request's queue gets its outputs in the worker's order, then nothing after a
    finished one, an exception or `WORKER_DIED`; once `alive` is False no queue is registered."""

    def __init__(self, worker_id: str, actor: Any, origin: str, on_died: Callable[[], None]):
        self.worker_id = worker_id
        self.actor = actor
        self.stream_id = f"{origin or 'coordinator'}/{uuid.uuid4().hex[:12]}"
        """What requests name as `reply_to`: unique per reader, so two coordinators (or two
        readers in one after a worker's replacement) never share a stream."""
        self._on_died = on_died
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[Delivery]] = {}
        self._alive = True
        self._closed = False
        self._opened = threading.Event()  # the worker's first (empty) batch came
        self._stream = actor.outputs.remote(self.stream_id)
        self._thread = threading.Thread(
            target=self._run, name=f"kvmesh-outputs-{worker_id}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._alive

    def wait_open(self, timeout_s: float) -> bool:
        """Wait until the worker has opened the stream (requests may name it then); False if it
        broke first or did not open in time."""
        deadline = time.monotonic() + timeout_s
        while not self._opened.wait(0.05):
            if not self.alive or time.monotonic() > deadline:
                return False
        return self.alive

    def register(self, request_id: str) -> queue.SimpleQueue[Delivery] | None:
        """The queue `request_id`'s outputs will arrive on; None if the stream already broke."""
        with self._lock:
            if not self._alive:
                return None
            q: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
            self._queues[request_id] = q
            return q

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def close(self) -> None:
        """Stop reading (the coordinator is stopping); the worker aborts what is left."""
        with self._lock:
            self._closed = True
        ray.cancel(self._stream)

    def _run(self) -> None:
        why, died = "its output stream ended", False
        try:
            for ref in self._stream:
                batch = ray.get(ref)
                self._opened.set()
                for request_id, item in batch:
                    with self._lock:
                        q = self._queues.get(request_id)
                    if q is not None:
                        q.put(item)
        except RayActorError as exc:
            why, died = _first_line(exc), True
        except RayError as exc:  # cancelled (closed), or Ray itself is going away
            why = _first_line(exc)
        except Exception as exc:  # a batch that does not decode: fail its requests, not silently
            log.exception("worker %s: output stream failed", self.worker_id)
            why = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._alive = False
            waiting = list(self._queues.values())
            self._queues.clear()
            closed = self._closed
        for q in waiting:
            q.put(WORKER_DIED)
        if not closed:
            log.info("worker %s: output stream closed (%s)", self.worker_id, why)
        if died:
            self._on_died()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0]
