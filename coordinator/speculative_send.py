"""One request's speculative dispatch: sent to its worker before its decision is committed.

    decided A  -> send(A): the request goes to A now; the commit travels meanwhile
    commit won -> nothing more: the stream from A is the request's
    commit lost, decided B -> send(B): the stream from A is closed (the worker aborts the
                  request and frees its work; nothing A produced is read), the request goes to
                  B under a new id (`decision_replica.redirected_id`)

`DecisionReplica.route` decides when to send; this class only sends and aborts, through the
backend's `send` (`contract.py`: closing a sent stream, read or not, aborts the request).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from kvmesh.coordinator.contract import WorkerBackend
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.policy import RouteDecision
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import WorkerRequest


class SpeculativeSend:
    """Invariant: at most one of the request's copies is live (`stream`): each `send` closes
    the one before it first."""

    def __init__(
        self,
        backend: WorkerBackend,
        make_request: Callable[[RouteDecision, str], WorkerRequest],
    ) -> None:
        """`make_request(decision, request_id)`: the `WorkerRequest` that carries out
        `decision` under `request_id` (its pull plan included)."""
        self.backend = backend
        self.make_request = make_request
        self.worker_id: WorkerId | None = None
        self.request: WorkerRequest | None = None
        self.stream: Generator[RequestOutput, None, None] | None = None
        """The live copy's outputs, unread; None before the first send and after `abort`."""
        self.num_sends = 0

    def send(self, decision: RouteDecision, request_id: str) -> None:
        """Send the request to `decision`'s worker, aborting the copy sent before (if any)."""
        self.abort()
        request = self.make_request(decision, request_id)
        self.stream = self.backend.send(decision.worker_id, request)
        self.worker_id, self.request = decision.worker_id, request
        self.num_sends += 1

    def abort(self) -> None:
        """Abort the live copy on its worker (a redirect, or routing failed after a send)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
