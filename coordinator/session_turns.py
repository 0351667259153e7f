"""One turn in flight per session, for the requests that ask for it.

A chat's next turn quotes the previous answer, so two turns of one session running at once are
a client bug (or a retry racing its original); a request may ask the coordinator to refuse such a
turn (`TurnMode.REFUSE` -> FAILED_PRECONDITION) or to hold it until the session is free
(`TurnMode.QUEUE`, bounded by a timeout, then refused the same way). Turns that ask for neither
(`TurnMode.CONCURRENT`) are counted but never held, so an exclusive turn still sees them.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class TurnMode(enum.Enum):
    CONCURRENT = "concurrent"
    """No check (the default): turns of one session may overlap."""
    REFUSE = "refuse"
    """Refuse the turn while another turn of its session is in flight."""
    QUEUE = "queue"
    """Wait (up to the coordinator's session_queue_timeout_s) for the session to be free."""


class SessionBusy(RuntimeError):
    """Another turn of the session is in flight (maps to FAILED_PRECONDITION)."""


class SessionTurns:
    """Turns in flight per session; thread-safe (streams end on the gRPC server's threads).

    Invariants (checked by `check_invariants`): every count is >= 1 (a session with no turn in
    flight has no entry); num_waiting >= 0.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self.num_waiting = 0
        self.num_refused = 0

    def num_in_flight(self, session_id: str) -> int:
        with self._cond:
            return self._in_flight.get(session_id, 0)

    def begin(self, session_id: str, mode: TurnMode, timeout_s: float = 0.0) -> None:
        """Start a turn of `session_id`; raises `SessionBusy` when `mode` forbids overlapping
        and the session stays busy (QUEUE: for `timeout_s`). Pair every success with `end`."""
        if not session_id:
            return
        with self._cond:
            busy = self._in_flight.get(session_id, 0) > 0
            if busy and mode is TurnMode.QUEUE:
                deadline = self._clock() + timeout_s
                self.num_waiting += 1
                try:
                    while self._in_flight.get(session_id, 0) > 0:
                        left = deadline - self._clock()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    self.num_waiting -= 1
                busy = self._in_flight.get(session_id, 0) > 0
            if busy and mode is not TurnMode.CONCURRENT:
                self.num_refused += 1
                raise SessionBusy(
                    f"session {session_id!r} already has a turn in flight"
                    + (f" (waited {timeout_s:g} s)" if mode is TurnMode.QUEUE else "")
                )
            self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1

    def end(self, session_id: str) -> None:
        if not session_id:
            return
        with self._cond:
            left = self._in_flight.get(session_id, 0) - 1
            if left < 0:
                raise ValueError(f"session {session_id!r} ended more turns than it began")
            if left:
                self._in_flight[session_id] = left
            else:
                del self._in_flight[session_id]
                self._cond.notify_all()

    def check_invariants(self) -> None:
        with self._cond:
            assert all(n >= 1 for n in self._in_flight.values()), self._in_flight
            assert self.num_waiting >= 0
