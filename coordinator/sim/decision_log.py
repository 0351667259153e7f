"""The fleet's decision log in simulated time (`routing/decision_log.py` for the protocol).

The simulator runs one replica at a time, in time order, so commits are atomic in call order, as
Redis' script makes them live. An entry reaches every replica's stream `delay_ms` after it was
committed; a replica deciding before it lands decides without it, and its commit loses if the
entry is already in the log: the conflicts of replicas deciding at the same simulated time. The
commit's round trip costs the request `trip_ms` per attempt (the simulator adds it to the
request's times: `ClusterSimulation`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from kvmesh.coordinator.routing.decision_log import CommitResult
from kvmesh.proto.placements import Placement


class LogReader(Protocol):
    """A replica's side of the log (`decision_replica.py`'s `DecisionReplica`)."""

    def observe(self, entries: Sequence[tuple[int, Placement]]) -> None: ...


class SimDecisionLog:
    """Invariants: entries are in commit order, their commit times non-decreasing; every
    replica's delivered count is <= len(entries)."""

    def __init__(self, now_ms: Callable[[], float], delay_ms: float, num_readers: int) -> None:
        if not delay_ms >= 0 or num_readers < 1:
            raise ValueError(f"need delay_ms >= 0 and readers >= 1: {delay_ms}, {num_readers}")
        self._now_ms = now_ms
        self.delay_ms = delay_ms
        self._committed_ms: list[float] = []
        self._entries: list[Placement] = []
        self._delivered = [0] * num_readers

    def __len__(self) -> int:
        return len(self._entries)

    def commit(self, expected_seq: int | None, placement: Placement) -> CommitResult:
        seq = len(self._entries)
        if expected_seq is None or expected_seq == seq:
            self._entries.append(placement)
            self._committed_ms.append(self._now_ms())
            return CommitResult(True, seq + 1)
        missed = tuple((s + 1, self._entries[s]) for s in range(max(expected_seq, 0), seq))
        return CommitResult(False, seq, missed)

    def deliver(self, readers: Sequence[LogReader]) -> None:
        """Hand every reader the entries that reached its stream by now."""
        landed = self._now_ms() - self.delay_ms
        n = len(self._entries)
        for k, reader in enumerate(readers):
            start = end = self._delivered[k]
            while end < n and self._committed_ms[end] <= landed:
                end += 1
            if end > start:
                reader.observe([(s + 1, self._entries[s]) for s in range(start, end)])
                self._delivered[k] = end

    def check_invariants(self) -> None:
        assert len(self._committed_ms) == len(self._entries)
        assert all(a <= b for a, b in itertools.pairwise(self._committed_ms))
        assert all(d <= len(self._entries) for d in self._delivered)
