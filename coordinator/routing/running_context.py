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

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.worker_rows import WorkerRows


class RunningContext:
    """Per-worker sums of the prompt tokens of requests routed there and not done.

    Invariants: tokens(w) == sum of num_tokens of w's entries; entries are in routing order.
    An entry is three dict values (when routed, worker, tokens) rather than one object: a
    routed request then leaves nothing young for the garbage collector to count or walk.
    """

    def __init__(self, ttl_s: float = 600.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._routed_s: OrderedDict[str, float] = OrderedDict()  # in routing order
        self._worker_of: dict[str, WorkerId] = {}
        self._tokens_of: dict[str, int] = {}
        self._rows = WorkerRows(tokens=np.int64)

    def __len__(self) -> int:
        return len(self._routed_s)

    def tokens(self, worker: WorkerId) -> int:
        return int(self._rows.value("tokens", worker))

    def tokens_many(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`tokens` of each worker, in order, as one array."""
        return self._rows.gather("tokens", workers)

    def add(self, request_id: str, worker: WorkerId, num_tokens: int, now_s: float) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.discard(request_id)
        self._routed_s[request_id] = now_s
        self._worker_of[request_id] = worker
        self._tokens_of[request_id] = num_tokens
        self._rows.add("tokens", worker, num_tokens)

    def discard(self, request_id: str) -> None:
        if self._routed_s.pop(request_id, None) is not None:
            self._take(self._worker_of.pop(request_id), self._tokens_of.pop(request_id))

    def expire(self, now_s: float) -> None:
        routed_s = self._routed_s
        while routed_s:
            request_id, at_s = next(iter(routed_s.items()))
            if now_s - at_s < self.ttl_s:
                return
            self.discard(request_id)

    def forget_worker(self, worker: WorkerId) -> None:
        for request_id in [r for r, w in self._worker_of.items() if w == worker]:
            del self._routed_s[request_id], self._worker_of[request_id]
            del self._tokens_of[request_id]
        self._rows.release(worker)

    def _take(self, worker: WorkerId, num_tokens: int) -> None:
        # An idle worker keeps its row (at 0): releasing it would drop the fleet's cached rows.
        self._rows.set("tokens", worker, self.tokens(worker) - num_tokens)

    def check_invariants(self) -> None:
        assert self._routed_s.keys() == self._worker_of.keys() == self._tokens_of.keys()
        sums: dict[WorkerId, int] = {}
        for r, w in self._worker_of.items():
            sums[w] = sums.get(w, 0) + self._tokens_of[r]
        sums = {w: t for w, t in sums.items() if t}
        held = {w: self.tokens(w) for w in sums}
        assert sums == held, (sums, held)
        num_holding = int(np.count_nonzero(self._rows.columns["tokens"]))
        assert num_holding == len(sums), "a worker with no request holds tokens"
        self._rows.check_invariants()
        times = list(self._routed_s.values())
        assert times == sorted(times)
