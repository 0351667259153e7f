"""A worker's request notes since it last published them (`proto/request_notes.py`).

The engine notes each request it takes, prefills and lets go of; after the step the shell
publishes the batch beside the step's KV events, and every coordinator replica learns what the
others routed here. The simulated worker keeps one too, so the simulator replays the same notes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.proto.request_notes import (
    NoteBatch,
    RequestFinished,
    RequestNote,
    RequestPrefilled,
    RequestTaken,
)


class NoteLog:
    """Invariant: notes are kept in the order they happened until `drain`."""

    def __init__(self, worker_id: str, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.worker_id = worker_id
        self._wall_ns = wall_ns
        self._notes: list[RequestNote] = []

    def __len__(self) -> int:
        return len(self._notes)

    def taken(self, request_id: str, origin: str, prompt_len: int, uncached_len: int) -> None:
        self._notes.append(RequestTaken(request_id, origin, prompt_len, uncached_len))

    def prefilled(self, request_id: str) -> None:
        self._notes.append(RequestPrefilled(request_id))

    def finished(self, request_id: str) -> None:
        self._notes.append(RequestFinished(request_id))

    def drain(self) -> NoteBatch | None:
        """The notes since the last drain, as one batch (None: nothing happened)."""
        if not self._notes:
            return None
        notes, self._notes = tuple(self._notes), []
        return NoteBatch(self.worker_id, notes, self._wall_ns() // 1_000_000)
