"""The decision log on Redis, for one coordinator replica (`routing/decision_log.py`).

`commit` is one call of the store's compare-and-set script. A thread follows the log's stream
and hands every entry (every replica's, this one's too) to the coordinator, which applies each
once, in sequence order, whichever came first: the stream or a lost commit's reply. A replica
starts at the log's end (the decisions before it are in the workers' load reports and the
index), and starts over at the log's end when Redis lost the log (a restart without
persistence). While Redis is away `commit` returns None: the replica decides alone and counts it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvmesh.coordinator.index.store import IndexStore, StoreError
from kvmesh.coordinator.routing.decision_log import CommitResult
from kvmesh.proto.placements import Placement

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 100
_RETRY_S = 0.2

Entries = Sequence[tuple[int, Placement]]


class DecisionStream:
    """Invariant: `after_seq` only goes back when the log in Redis went back (lost)."""

    def __init__(self, store: IndexStore) -> None:
        self.store = store
        self.on_entries: Callable[[Entries], None] = lambda _entries: None
        """The coordinator's `decisions.observe` (`DecisionReplica`)."""
        self.on_jump: Callable[[int], None] = lambda _seq: None
        """The coordinator's `decisions.skip_to`: the log's entries up to a seq are not to be
        had (a start, a trimmed or lost log)."""
        self.after_seq = 0
        self.num_failed_commits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-decisions", daemon=True)

    def start(self) -> None:
        try:
            self._jump(self.store.decision_seq())
        except StoreError as exc:
            log.warning("decision log: Redis unreachable at start (%s)", exc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def commit(self, expected_seq: int | None, placement: Placement) -> CommitResult | None:
        try:
            return self.store.commit_decision(expected_seq, placement)
        except StoreError as exc:
            if self.num_failed_commits == 0:
                log.warning("decision log: commit failed (%s); deciding alone", exc)
            self.num_failed_commits += 1
            return None

    def poll_once(self, block_ms: int | None = _READ_BLOCK_MS) -> int:
        """Hand over the entries after `after_seq`; returns how many."""
        entries = self.store.read_decisions(self.after_seq, block_ms)
        if entries and entries[0][0] > self.after_seq + 1:
            self.on_jump(entries[0][0] - 1)  # trimmed before this replica read them
        if entries:
            self.after_seq = entries[-1][0]
            self.on_entries(entries)
        return len(entries)

    def _jump(self, seq: int) -> None:
        self.after_seq = seq
        self.on_jump(seq)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                if failing:
                    seq = self.store.decision_seq()
                    if seq < self.after_seq:  # Redis lost the log: start over at its end
                        self._jump(seq)
                    failing = False
                self.poll_once()
            except StoreError as exc:
                if not failing:
                    log.warning("decision log: lost Redis (%s)", exc)
                failing = True
                self._stop.wait(_RETRY_S)
            except Exception:  # a bug must not stop the log: start over at its end
                log.exception("decision log: following the stream failed")
                failing = True
                self._stop.wait(_RETRY_S)
