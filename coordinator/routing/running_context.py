"""The KV each worker's running requests read per decode step, as far as the router knows it.

A decode step reads every running sequence's whole context (a prefix several sequences share is
read once per sequence by the attention kernel), so what a worker's batch adds to each step grows
with the sum of its requests' prompt lengths, not with their number: ten 20K-token conversations
slow a step far more than ten 2K-token questions. Tokens generated since are not counted (the
router does not see them); requests that are never reported done leave after `ttl_s`, which
bounds the memory when a caller never calls `discard`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.worker_rows import WorkerRows


class _Running(NamedTuple):  # (one per routed request: a tuple is made faster)
    worker: WorkerId
    num_tokens: int
    routed_s: float


class RunningContext:
    """Per-worker sums of the prompt tokens of requests routed there and not done.

    Invariants: tokens(w) == sum of num_tokens of w's entries; entries are in routing order.
    """

    def __init__(self, ttl_s: float = 600.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Running] = OrderedDict()
        self._rows = WorkerRows(tokens=np.int64)

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, worker: WorkerId) -> int:
        return int(self._rows.value("tokens", worker))

    def tokens_many(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`tokens` of each worker, in order, as one array."""
        return self._rows.gather("tokens", workers)

    def add(self, request_id: str, worker: WorkerId, num_tokens: int, now_s: float) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.discard(request_id)
        self._entries[request_id] = _Running(worker, num_tokens, now_s)
        self._rows.add("tokens", worker, num_tokens)

    def discard(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._take(entry)

    def expire(self, now_s: float) -> None:
        while self._entries:
            request_id, entry = next(iter(self._entries.items()))
            if now_s - entry.routed_s < self.ttl_s:
                return
            del self._entries[request_id]
            self._take(entry)

    def forget_worker(self, worker: WorkerId) -> None:
        for request_id in [r for r, e in self._entries.items() if e.worker == worker]:
            del self._entries[request_id]
        self._rows.release(worker)

    def _take(self, entry: _Running) -> None:
        # An idle worker keeps its row (at 0): releasing it would drop the fleet's cached rows.
        self._rows.set("tokens", entry.worker, self.tokens(entry.worker) - entry.num_tokens)

    def check_invariants(self) -> None:
        sums: dict[WorkerId, int] = {}
        for e in self._entries.values():
            sums[e.worker] = sums.get(e.worker, 0) + e.num_tokens
        sums = {w: t for w, t in sums.items() if t}
        held = {w: self.tokens(w) for w in sums}
        assert sums == held, (sums, held)
        num_holding = int(np.count_nonzero(self._rows.columns["tokens"]))
        assert num_holding == len(sums), "a worker with no request holds tokens"
        self._rows.check_invariants()
        times = [e.routed_s for e in self._entries.values()]
        assert times == sorted(times)
