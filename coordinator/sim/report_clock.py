"""When the workers' load reports are taken: on arrivals (the default) or on a clock of their own.

The live health loop (`Cluster._watch`) waits its interval, then asks every worker for its
`WorkerInfo`: each report is the worker's state at a tick of that loop's own clock, whatever
arrives meanwhile, so a routing decision reads a report 0 to one interval old. The simulator's
default takes a report at the first arrival an interval after the last one, just before that
arrival is routed: that decision reads a report of the state it is routed in.

    ticks:      0         I         2I        3I
    events:   a   a  w      a  w w     (none)    a
    taken:   ^0          ^I          ^2I          ^4I (3I and 4I: one report, nothing changed)

On its own clock a report is taken before the first event at or after a tick (arrival, dispatch
or worker event), so it reads what every earlier event left: the state at the tick, as workers'
queues change only at events. Ticks with no event between them give one report.
"""

from __future__ import annotations

import math


class ReportClock:
    """Says, before each event or as an arrival is routed, whether the workers' reports are due.

    Invariants: on the clock, `next_tick` > the tick of the last report taken (0 before any);
    on arrivals, a report is due once `interval_ms` has passed since `last_ms`."""

    def __init__(self, interval_ms: float, on_clock: bool) -> None:
        if not interval_ms > 0:
            raise ValueError(f"need a report interval > 0, got {interval_ms} ms")
        self.interval_ms = interval_ms
        self.on_clock = on_clock
        self.next_tick = 0
        self.last_ms = -math.inf
        self.num_reports = 0

    def due_before_event(self, event_ms: float) -> bool:
        """Take the reports now, before an event at `event_ms`? (On arrivals: never here.)"""
        if not self.on_clock or event_ms < self.next_tick * self.interval_ms:
            return False
        self.next_tick = math.floor(event_ms / self.interval_ms) + 1
        self._taken(event_ms)
        return True

    def due_on_arrival(self, arrival_ms: float) -> bool:
        """Take the reports now, as an arrival is about to be routed? (On the clock: never.)"""
        if self.on_clock or arrival_ms - self.last_ms < self.interval_ms:
            return False
        self._taken(arrival_ms)
        return True

    def _taken(self, now_ms: float) -> None:
        self.last_ms = now_ms
        self.num_reports += 1

    def check_invariants(self) -> None:
        assert self.interval_ms > 0 and self.next_tick >= 0
        if self.on_clock and self.num_reports:
            assert self.last_ms < self.next_tick * self.interval_ms, (self.last_ms, self.next_tick)
