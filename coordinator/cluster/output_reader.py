"""One worker's output stream to this coordinator, split back into its requests, and the way
this coordinator's requests travel to that worker (`submit`, `wait_accepted`, `abort`).

A thread reads the worker's `outputs` stream (a batch of outputs per message, every request this
coordinator submitted there; the first batch, empty, says the stream is open) and hands each
output to the queue of the request's caller:

    worker --outputs(stream_id)--> reader thread --> queue per request --> Cluster.generate

When the worker runs on this coordinator's node, the stream, and the requests' submits and
aborts, go through its side door (`side_door.py`, a Unix socket) instead of Ray; the reader's
thread opens it before the stream is open, and uses Ray when it cannot (another node, a door
that fails to open, `use_side_door=False`).

When the stream breaks (the worker's actor died or was killed), every request still waiting gets
`WORKER_DIED` and the reader is done; the next request to that worker opens a new one.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Final, TypeAlias

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from kvmesh.coordinator.cluster.side_door import SideDoor, SideDoorClosed
from kvmesh.coordinator.contract import WorkerDied
from kvmesh.workers.contract.replies import RequestOutput, RequestRejected, WorkerFailed
from kvmesh.workers.contract.requests import WorkerRequest

log = logging.getLogger(__name__)

WORKER_DIED: Final = "worker died"
"""What a request's queue gets when its worker's stream broke."""

Delivery: TypeAlias = RequestOutput | Exception | str

Submitted: TypeAlias = "Future[None] | ray.ObjectRef"
"""A submit on its way: a side door's future, or Ray's reference to the `submit` call."""

_DOOR_LOOKUP_TIMEOUT_S = 30.0
_DEATH_CHECK_TIMEOUT_S = 10.0


class OutputReader:
    """Invariants: a request's queue gets its outputs in the worker's order, then nothing after a
    finished one, an exception or `WORKER_DIED`; once `alive` is False no queue is registered."""

    def __init__(
        self,
        worker_id: str,
        actor: Any,
        origin: str,
        on_died: Callable[[], None],
        use_side_door: bool = True,
    ):
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
        self._use_side_door = use_side_door
        self._door: SideDoor | None = None  # set, or not, by the thread before the stream opens
        self._stream: Any = None
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

    @property
    def via_side_door(self) -> bool:
        """Whether this stream and its requests' calls go through the side door (known once
        the stream is open)."""
        return self._door is not None

    def submit(self, request: WorkerRequest) -> Submitted:
        """Send `request` to the worker, replying to this stream (call after `wait_open`)."""
        request = dataclasses.replace(request, reply_to=self.stream_id)
        if self._door is not None:
            return self._door.submit(request)
        return self.actor.submit.remote(request)

    def wait_accepted(self, submitted: Submitted) -> None:
        """Wait until the worker took a submitted request; raises what its `submit` raised
        (RequestRejected, WorkerFailed), or WorkerDied."""
        try:
            if isinstance(submitted, Future):
                submitted.result()
            else:
                ray.get(submitted)
        except SideDoorClosed:
            raise WorkerDied(self.worker_id) from None  # `_run` tells the registry if it died
        except RayTaskError as exc:
            cause = exc.cause if hasattr(exc, "cause") else None
            if isinstance(cause, RequestRejected | WorkerFailed):
                raise cause from None
            if isinstance(exc, RayActorError):
                self._on_died()
                raise WorkerDied(self.worker_id) from None
            raise
        except RayActorError:
            self._on_died()
            raise WorkerDied(self.worker_id) from None

    def abort(self, request_id: str) -> None:
        """Stop `request_id` on the worker (its caller went away)."""
        if self._door is None or not self._door.abort(request_id):
            self.actor.abort.remote(request_id)

    def close(self) -> None:
        """Stop reading (the coordinator is stopping); the worker aborts what is left."""
        with self._lock:
            self._closed = True
            stream, door = self._stream, self._door
        if door is not None:
            door.close()
        if stream is not None:
            ray.cancel(stream)

    def _open_door(self) -> SideDoor | None:
        """The worker's side door if it runs on this node and the door opens, else None."""
        if not self._use_side_door:
            return None
        try:
            address = ray.get(
                self.actor.request_channel_address.remote(), timeout=_DOOR_LOOKUP_TIMEOUT_S
            )
            if address is None or address[0] != ray.get_runtime_context().get_node_id():
                return None
            return SideDoor.connect(address[1], self.stream_id)
        except (OSError, RayError, AttributeError) as exc:  # AttributeError: a worker without one
            log.warning("worker %s: no side door, using Ray: %s", self.worker_id, exc)
            return None

    def _batches(self) -> Iterator[list[Any]]:
        door = self._open_door()
        with self._lock:
            if self._closed:
                if door is not None:
                    door.close()
                return
            self._door = door
            if door is None:
                self._stream = self.actor.outputs.remote(self.stream_id)
        if door is not None:
            yield from door.batches()
            return
        for ref in self._stream:
            yield ray.get(ref)

    def _run(self) -> None:
        why, died = "its output stream ended", False
        try:
            for batch in self._batches():
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
        if self._door is not None and not closed:
            died = self._actor_is_dead()  # after the waiting requests heard: this takes a call
        if died:
            self._on_died()

    def _actor_is_dead(self) -> bool:
        """Whether Ray says the worker's actor died (a side door's end does not say why)."""
        try:
            ray.get(self.actor.ping.remote(), timeout=_DEATH_CHECK_TIMEOUT_S)
        except RayActorError:
            return True
        except (RayError, GetTimeoutError):
            return False  # the health watch judges a worker that does not answer
        return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0]
