"""The simulated workers as the real `Coordinator` sees them: a `WorkerBackend`.

`generate` queues the request on its `SimWorker` (at once, or once `dispatch_delay_ms` has
passed: the decision log's commits; the pull plan the coordinator attached becomes a
`PullSource` on the peer's pool) and returns the request's stream of outputs, which the
simulation feeds as simulated time produces them: the first token with its `PrefillFacts`, then
the last. The simulation reads one event from the coordinator's stream per output it feeds, so a
stream is never read ahead of simulated time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from kvmesh.coordinator.sim.worker import PullSource, SimRequest, SimSequence, SimWorker
from kvmesh.workers.contract.replies import PrefillFacts, RequestOutput
from kvmesh.workers.contract.requests import WorkerRequest


class SimBackend:
    """Invariant: a request id has an outbox from `generate` until its final output is read."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self.workers = list(workers)
        self._index_of = {w.worker_id: i for i, w in enumerate(self.workers)}
        self._requests: dict[str, SimRequest] = {}
        self._outboxes: dict[str, deque[RequestOutput]] = {}
        self.host_tokens: list[int] = []
        """Prompt tokens each prefill promoted from a host tier (in prefill order)."""
        self.touched: list[int] = []
        """Workers that got a request since the simulation last looked (it admits on them)."""
        self.dispatch_delay_ms: Callable[[], float] = lambda: 0.0
        """How long a request being sent now takes to reach its worker (the decision log's
        commits before it); 0: at once."""
        self.deferred: list[tuple[float, int, SimRequest, PullSource | None, str]] = []
        """Requests on their way, as (delay ms, worker, request, pull, origin): the simulation
        hands each to `deliver` once its delay has passed."""
        self.pending: list[tuple[int, SimRequest, PullSource | None, str]] = []
        """Requests that reach their worker at once, as (worker, request, pull, origin), until
        the simulation calls `deliver_pending` as the coordinator's call returns, at the same
        simulated time: the worker queueing a request is the worker's work, not the routing
        decision's, which the simulation times (a live backend calls the worker only when the
        stream is first read)."""

    def expect(self, request: SimRequest) -> None:
        """The simulated request behind the `WorkerRequest` the coordinator is about to send."""
        self._requests[request.request_id] = request

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        sim_request = self._requests.pop(request.request_id)
        pull = None
        if request.pull is not None:
            source = self.workers[self._index_of[request.pull.source]]
            pull = PullSource(source.pool, request.pull.end_block)
        w = self._index_of[worker_id]
        delay_ms = self.dispatch_delay_ms()
        if delay_ms > 0:
            self.deferred.append((delay_ms, w, sim_request, pull, request.origin))
        else:
            self.pending.append((w, sim_request, pull, request.origin))
        outbox: deque[RequestOutput] = deque()
        self._outboxes[request.request_id] = outbox
        return _read(outbox)

    def deliver_pending(self) -> None:
        """Deliver the requests that reach their worker at once (`pending`), in routing order."""
        for w, request, pull, origin in self.pending:
            self.deliver(w, request, pull, origin)
        self.pending.clear()

    def deliver(self, w: int, request: SimRequest, pull: PullSource | None, origin: str) -> None:
        """The request reaches worker `w` now."""
        self.workers[w].enqueue(request, pull, origin)
        self.touched.append(w)

    def first_token(self, seq: SimSequence) -> None:
        request = seq.request
        self.host_tokens.append(seq.host_tokens)
        facts = PrefillFacts(
            local_tokens=seq.cached_tokens - seq.host_tokens,
            host_tokens=seq.host_tokens,
            pulled_tokens=seq.pulled_tokens,
            computed_tokens=request.prompt_len - seq.cached_tokens - seq.pulled_tokens,
        )
        self._outboxes[request.request_id].append(
            RequestOutput(request.request_id, (0,), False, "", facts)
        )

    def last_token(self, seq: SimSequence) -> None:
        rid = seq.request.request_id
        self._outboxes.pop(rid).append(RequestOutput(rid, (0,), True, "length"))


def _read(outbox: deque[RequestOutput]) -> Iterator[RequestOutput]:
    while outbox:
        yield outbox.popleft()
