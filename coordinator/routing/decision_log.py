"""The fleet-wide decision log, as one coordinator replica sees it.

Replicas over one fleet become a replicated state machine: every routing decision is committed
to one ordered log by compare-and-set on the log's sequence (`DecisionLog.commit`), and every
replica applies the log's entries (`proto/placements.py`) in sequence order to its load tracker
and its policy state. A replica decides on the state after entry `applied_seq`; the commit
succeeds only if the log still ends there. Otherwise the log returns the entries the replica
missed; it applies them, decides again on the fuller state and retries (after `max_retries`
lost commits it appends unconditionally and counts it):

    log:      1  2  3  4  5
    replica A decided after 4, commits at 5          -> committed, seq 5
    replica B decided after 4 too, commits           -> lost: gets 5, applies it, decides again
                                                        after 5, commits at 6

So every replica's policy state is the sequence of decisions one coordinator would have made
(each decision seeing every earlier one), whichever replica made them. Entries also reach every
replica through the log's stream (`DecisionStream` live, the simulator's log in simulation);
`LogCursor` applies each once, in order, whichever way it came first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.proto.placements import Placement


@dataclass(frozen=True, slots=True)
class CommitResult:
    committed: bool
    seq: int
    """The log's sequence after the call: the committed entry's, or the one the log ends at."""
    missed: tuple[tuple[int, Placement], ...] = field(default_factory=tuple)
    """On a lost commit: the entries after the caller's expected seq, in order (as many as
    the log still holds)."""


class DecisionLog(Protocol):
    """Where replicas commit decisions: Redis live (`index/decision_stream.py`), an in-memory
    log in the simulator."""

    def commit(self, expected_seq: int | None, placement: Placement) -> CommitResult | None:
        """Append `placement` if the log ends at `expected_seq` (None: whatever it ends at);
        None: the log is unreachable (the replica decides alone)."""
        ...


class LogCursor:
    """Applies the log's entries in sequence order, each once.

    Invariants: every pending entry's seq is > applied_seq + 1 (it waits for a gap to fill);
    applied_seq never goes back.
    """

    def __init__(self, applied_seq: int = 0, max_pending: int = 100_000) -> None:
        if applied_seq < 0 or max_pending < 1:
            raise ValueError(
                f"need applied_seq >= 0, max_pending >= 1: {applied_seq}, {max_pending}"
            )
        self.applied_seq = applied_seq
        self.max_pending = max_pending
        self._pending: dict[int, Placement] = {}
        self.num_skipped = 0
        """Entries never seen, stepped over (trimmed from the log, or a pending overflow)."""

    def offer(self, entries: Sequence[tuple[int, Placement]]) -> list[Placement]:
        """Take entries (any order, duplicates allowed); returns those now due, in order."""
        for seq, placement in entries:
            if seq > self.applied_seq:
                self._pending[seq] = placement
        due: list[Placement] = []
        while self.applied_seq + 1 in self._pending:
            self.applied_seq += 1
            due.append(self._pending.pop(self.applied_seq))
        if len(self._pending) > self.max_pending:  # a gap that never fills: step over it
            due.extend(self.skip_to(min(self._pending) - 1))
        return due

    def skip_to(self, seq: int) -> list[Placement]:
        """The entries up to `seq` are not to be had (trimmed, or a fresh start): continue
        after it; returns the pending entries that became due. A `seq` below `applied_seq`
        means the log itself went back (Redis lost it): start over there."""
        if seq < self.applied_seq:
            self._pending.clear()
            self.applied_seq = seq
            return []
        if seq == self.applied_seq:
            return []
        self.num_skipped += seq - self.applied_seq - sum(1 for s in self._pending if s <= seq)
        due = [self._pending.pop(s) for s in sorted(s for s in self._pending if s <= seq)]
        self.applied_seq = seq
        return due + self.offer(())

    def check_invariants(self) -> None:
        assert self.applied_seq >= 0
        assert all(s > self.applied_seq + 1 for s in self._pending), (
            self.applied_seq,
            sorted(self._pending)[:5],
        )
