"""The thread that sends an engine's KV events and request notes to Redis, batch after batch in
the order the engine drained them, and hands out the outputs that had to wait for them.

    engine:  step N -> first, middle outputs out -> send(events, last outputs) -> step N + 1
    sender:                               publish step N's events (a round trip) -> its last outputs

A request's last output still leaves only once its blocks are announced (its step's events
published, or their publishing failed: the worker serves on without Redis); the engine no longer
waits out the round trip (0.3-3 ms, an 8K prefill's 512 blocks ~1.5 ms) before its next step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.proto.events import EventBatch
from kvmesh.proto.request_notes import NoteBatch
from kvmesh.workers.contract.replies import RequestOutput

log = logging.getLogger(__name__)

Publish = Callable[[EventBatch | None, NoteBatch | None], None]
"""Writes one step's events and notes (either may be None) to Redis; never raises for Redis."""
Deliver = Callable[[str, RequestOutput], None]

MAX_PENDING = 8
"""Sends that may wait at once before the engine waits too. A prefill that evicted sends ~1,000
block events (a longer Redis script than a step's usual few), and the steps right after it send
again: at two, the engine waited out such scripts (a profile of an 8B worker on an H100 found it
blocked there), while a step's last outputs wait behind the sends before theirs either way."""


@dataclass(frozen=True, slots=True)
class _Send:
    events: EventBatch | None
    notes: NoteBatch | None
    outputs: tuple[RequestOutput, ...]


class EventSender:
    """Invariants: sends are published, and their outputs delivered, in the order `send` took
    them; at most `max_pending` wait or run at once (`send` blocks while that many do)."""

    def __init__(self, publish: Publish, deliver: Deliver, max_pending: int = MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._publish = publish
        self._deliver = deliver
        self._max_pending = max_pending
        self._pending: deque[_Send] = deque()
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-events", daemon=True)
        self._thread.start()

    def send(
        self,
        events: EventBatch | None,
        notes: NoteBatch | None,
        outputs: tuple[RequestOutput, ...] = (),
    ) -> None:
        """Publish `events` and `notes`, then deliver `outputs`, after every earlier send. Waits
        only while `max_pending` sends are ahead. After `stop` it runs in the caller's thread."""
        item = _Send(events, notes, outputs)
        with self._changed:
            while not self._stopped and len(self._pending) >= self._max_pending:
                self._changed.wait()
            if not self._stopped:
                self._pending.append(item)
                self._changed.notify_all()
                return
        self._run(item)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every send so far has been published and delivered; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout_s)

    @property
    def idle(self) -> bool:
        with self._changed:
            return not self._pending

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish what was sent, then end the thread; later sends run in their caller."""
        self.flush(timeout_s)
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._stopped)
                if not self._pending:
                    return  # stopped, nothing left
                item = self._pending[0]
            self._run(item)
            with self._changed:
                self._pending.popleft()
                self._changed.notify_all()

    def _run(self, item: _Send) -> None:
        try:
            if item.events is not None or item.notes is not None:
                self._publish(item.events, item.notes)
        except Exception:  # a bug, not Redis (publish absorbs that): the outputs still go out
            log.exception("publishing a step's events failed")
        for output in item.outputs:
            self._deliver(output.request_id, output)
