"""The thread that owns a worker: every call that touches the worker's state runs on it, as a
closure from the actor's event loop (`submit`, `on_engine`), between engine steps, or under its
state lock while a step's forward pass runs (a peer's pin and unpin: `state_lock.py`).

    loop:  run queued calls -> step -> first and middle tokens out (first tokens: wait until
           their streams took them) -> hand the step's KV events, notes and last outputs to the
           sender -> heartbeat when due -> idle: write back to the host tier, or wait for a call

A first token goes out before the step's KV events; a request's last output only after them, so
a finished request's blocks are already announced. The wait for a first token's stream (at most
`HAND_OVER_S`, `OutputBatches.wait_taken`) lets the event loop that sends it run now instead of
after this thread's next step has let go of the interpreter lock. The sender thread
(`event_sender.py`) makes the Redis round trip, so the next step does not wait for it. A second
thread keeps the liveness key fresh while one iteration runs long.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

from kvmesh.proto.events import EventBatch
from kvmesh.proto.request_notes import NoteBatch
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.engine.event_publisher import EventPublisher
from kvmesh.workers.engine.state_lock import StateLock
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.event_sender import EventSender

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
HAND_OVER_S = 0.001
"""The longest the engine waits for the streams of a step's first tokens to take them."""
T = TypeVar("T")


class EngineThread:
    """Invariant: only this thread touches `worker` once `start` has run; `last_tick` is when
    the current iteration began (read by other threads to tell a stalled engine)."""

    def __init__(
        self,
        worker: Worker,
        config: WorkerConfig,
        publisher: EventPublisher | None,
        deliver: Callable[[str, RequestOutput | Exception], None],
        fail_all: Callable[[Exception], None],
        hand_over: Callable[[Sequence[str], float], object] | None = None,
    ) -> None:
        """`hand_over(request_ids, timeout_s)`: wait until the streams of those requests took
        what was delivered to them (`OutputStreams.wait_taken`); None: no wait."""
        self.worker = worker
        self.config = config
        self.publisher = publisher
        self._deliver = deliver
        self._fail_all = fail_all
        self._hand_over = hand_over
        self.lock = StateLock()
        """Held by this thread for each iteration but a step's forward pass and a wait for room
        in the sender (`state_lock.py`); a peer's pin or unpin takes it instead of queueing
        behind the step."""
        worker.state_lock = self.lock
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._last_heartbeat = 0.0
        self.last_tick = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._keepalive = threading.Thread(
            target=self._keep_alive, name="kvmesh-keepalive", daemon=True
        )
        self._sender = EventSender(self._publish_step, deliver) if publisher is not None else None

    def start(self) -> None:
        self.heartbeat()
        self._thread.start()
        self._keepalive.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        self._thread.join(timeout=5)
        self._keepalive.join(timeout=5)
        if self._sender is not None:
            self._sender.stop()
        if not self._thread.is_alive():
            self.worker.state_lock = None  # whoever steps the worker next does so without us

    def wake(self) -> None:
        self._wakeup.set()

    def submit(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread before its next step (nothing waits for it)."""
        self._inbox.put(fn)
        self._wakeup.set()

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and await its result (or its exception)."""
        reply: futures.Future[T] = futures.Future()

        def call() -> None:
            try:
                reply.set_result(fn())
            except Exception as exc:  # the caller gets the error; the engine keeps serving
                reply.set_exception(exc)

        self.submit(call)
        return await asyncio.wrap_future(reply)

    def publish(self, batch: Any) -> None:
        """Publish `batch` now, after everything the sender holds (on the engine thread)."""
        if self.publisher is not None:
            self._flush_sender()
            self.publisher.publish(batch)

    def heartbeat(self) -> None:
        self._last_heartbeat = time.monotonic()
        if self.publisher is not None:
            self.publisher.heartbeat(self._heartbeat_info(), self._ttl_ms())

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._warn_if_slow(self.last_tick)
            self.last_tick = time.monotonic()
            idle = False
            with self.lock:  # let go of in a step's forward pass and a wait for the sender
                try:
                    idle = self._iterate()
                except Exception as exc:  # keep serving: fail the running requests, not the worker
                    log.exception("engine step failed")
                    self._flush_sender()  # their outputs sent so far go out before the failure
                    self._fail_all(exc)
            if idle:
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()

    def _iterate(self) -> bool:
        """One pass of the loop; True when there is nothing to do until a call comes."""
        began, step_s = time.perf_counter(), 0.0
        self._drain_inbox()
        outputs: list[RequestOutput] = []
        if self.worker.has_work:
            stepped = time.perf_counter()
            outputs = self.worker.step()
            step_s = time.perf_counter() - stepped
        first_tokens = []
        for o in outputs:
            if not o.finished:
                self._deliver(o.request_id, o)
                if o.prefill is not None:
                    first_tokens.append(o.request_id)
        if first_tokens and self._hand_over is not None:
            with self.lock.released():  # a peer's pin need not wait for it either
                self._hand_over(first_tokens, HAND_OVER_S)
        self._send_events(tuple(o for o in outputs if o.finished))
        if time.monotonic() - self._last_heartbeat >= self.config.heartbeat_interval_s:
            self.heartbeat()
        self.worker.tally.on_engine_host((time.perf_counter() - began - step_s) * 1e3)
        if outputs or self.worker.has_work:
            return False
        # Idle: write back to the host tier while no call waits (more may be left: go on).
        wrote = self._inbox.empty() and self.worker.write_back_host(
            self.config.host_write_back_blocks
        )
        return not wrote

    def _keep_alive(self) -> None:
        """Keep the liveness key fresh while one engine iteration runs long: heartbeats (with
        the worker's info and the purge check) go out between iterations, and a kernel compile
        or a large pull can hold one for seconds, which must not get the worker purged. An
        engine stuck past `stall_limit_s` is let go: its key lapses and the fleet moves on."""
        interval = self.config.heartbeat_interval_s
        while not self._stopped.wait(interval):
            publisher = self.publisher
            stalled = time.monotonic() - self.last_tick
            if publisher is not None and interval <= stalled < self.config.stall_limit_s:
                publisher.keep_alive(self._ttl_ms())

    def _warn_if_slow(self, started: float) -> None:
        """Heartbeats go out between iterations: say so when one took half their TTL."""
        took = time.monotonic() - started
        if took > self.config.heartbeat_ttl_s / 2:
            log.warning(
                "engine iteration took %.2f s (heartbeat TTL %.1f s): a long step or pull delays"
                " this worker's heartbeat",
                took,
                self.config.heartbeat_ttl_s,
            )

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()  # what it changes in the pool (e.g. pulled blocks) is announced after the step

    def _send_events(self, finished: tuple[RequestOutput, ...]) -> None:
        """Hand the step's KV events and notes to the sender, with the outputs that wait for
        them (called with the state lock held, `_iterate`)."""
        # Request notes are hints for the other coordinators: dropped while Redis is away.
        notes = self.worker.drain_request_notes()
        if self.publisher is None or self._sender is None:
            self.worker.pool.drain_events()
            self._deliver_now(finished)
            return
        if self.publisher.lost_events:
            self._sender.flush()  # the full state goes out after every batch sent before
            if not self.publisher.heartbeat(self._heartbeat_info(), self._ttl_ms()):
                self._deliver_now(finished)
                return  # still unreachable; events keep accumulating in the pool
            self.publisher.lost_events = False
            self._sender.send(self.worker.full_state_batch(), None, finished)
            return
        batch = self.worker.drain_event_batch()
        if batch is None and notes is None and self._sender.idle:
            self._deliver_now(finished)  # nothing to announce, nothing announcing
            return
        # A full sender holds the engine back; a peer's pin need not wait with it.
        with self.lock.released():
            self._sender.send(batch, notes, finished)

    def _publish_step(self, batch: EventBatch | None, notes: NoteBatch | None) -> None:
        """The sender's Redis round trip for one step: its events and notes in one."""
        assert self.publisher is not None
        if batch is not None:
            self.publisher.publish(batch, notes)
        elif notes is not None and self.publisher.connected:
            self.publisher.publish_notes(notes)

    def _deliver_now(self, outputs: tuple[RequestOutput, ...]) -> None:
        for o in outputs:
            self._deliver(o.request_id, o)

    def _flush_sender(self) -> None:
        if self._sender is not None:
            self._sender.flush()

    def _heartbeat_info(self) -> dict[str, str | int]:
        i = self.worker.info()
        return {
            "node": i.node,
            "device": i.device,
            "pid": i.pid,
            "model": i.model,
            "block_size": i.block_size,
            "num_blocks": i.num_blocks,
            "num_free_blocks": i.num_free_blocks,
            "cache_epoch": i.cache.cache_epoch,
            "updated_ms": time.time_ns() // 1_000_000,
        }

    def _ttl_ms(self) -> int:
        return int(self.config.heartbeat_ttl_s * 1000)
