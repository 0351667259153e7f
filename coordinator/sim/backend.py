"""The simulated workers as the real `Coordinator` sees them: a `WorkerBackend`.

`generate` queues the request on its `SimWorker` (at once, or once `dispatch_delay_ms` has
passed: the decision log's commits; the pull plan the coordinator attached becomes a
`PullSource` on the peer's pool) and returns the request's stream of outputs, which the
simulation feeds as simulated time produces them: the first token with its `PrefillFacts`, then
the last. The simulation reads one event from the coordinator's stream per output it feeds, so a
stream is never read ahead of simulated time.

`send` does the same for speculative dispatch, where the coordinator sends before its commit
and may redirect: closing a sent stream before its worker got the request takes the request
back (the coordinator's whole routing call is one simulated instant, so an aborted copy never
reaches its worker: the few milliseconds of work a live worker may spend on it before the abort
lands are not modelled). A redirected request keeps its workload entry (`SimRequest.index`)
under the id the coordinator gave it, so the worker's notes name what the log names.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import cast

from kvmesh.coordinator.sim.worker import PullSource, SimRequest, SimSequence, SimWorker
from kvmesh.workers.contract.replies import PrefillFacts, RequestOutput
from kvmesh.workers.contract.requests import WorkerRequest

_Dispatch = tuple[int, SimRequest, PullSource | None, str]


class SimBackend:
    """Invariant: a workload request (by index) has an outbox from `generate` / `send` until its
    final output is read."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self.workers = list(workers)
        self._index_of = {w.worker_id: i for i, w in enumerate(self.workers)}
        self._expected: SimRequest | None = None
        self._outboxes: dict[int, deque[RequestOutput]] = {}
        self.host_tokens: list[int] = []
        """Prompt tokens each prefill promoted from a host tier (in prefill order)."""
        self.touched: list[int] = []
        """Workers that got a request since the simulation last looked (it admits on them)."""
        self.dispatch_delay_ms: Callable[[], float] = lambda: 0.0
        """How long a request being sent now takes to reach its worker (the decision log's
        commits before it); 0: at once."""
        self.deferred: list[tuple[float, _Dispatch]] = []
        """Requests on their way, as (delay ms, worker, request, pull, origin): the simulation
        hands each to `deliver` once its delay has passed."""
        self.pending: list[_Dispatch] = []
        """Requests that reach their worker at once, as (worker, request, pull, origin), until
        the simulation calls `deliver_pending` as the coordinator's call returns, at the same
        simulated time: the worker queueing a request is the worker's work, not the routing
        decision's, which the simulation times (a live backend calls the worker only when the
        stream is first read)."""

    def expect(self, request: SimRequest) -> None:
        """The simulated request behind the `WorkerRequest`s the coordinator is about to send
        (one, or more when it redirects)."""
        self._expected = request

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        self._queue(worker_id, request)
        return _read(self._outboxes[self._sim_request(request).index])

    def send(self, worker_id: str, request: WorkerRequest) -> Generator[RequestOutput, None, None]:
        dispatch = self._queue(worker_id, request)
        stream = _read_sent(self._outboxes[dispatch[1].index], lambda: self._take_back(dispatch))
        next(stream)  # started, so that closing it unread takes the request back
        return cast(Generator[RequestOutput, None, None], stream)

    def _sim_request(self, request: WorkerRequest) -> SimRequest:
        expected = self._expected
        assert expected is not None and request.request_id.startswith(expected.request_id)
        if request.request_id == expected.request_id:
            return expected
        return dataclasses.replace(expected, request_id=request.request_id)  # redirected

    def _queue(self, worker_id: str, request: WorkerRequest) -> _Dispatch:
        sim_request = self._sim_request(request)
        pull = None
        if request.pull is not None:
            source = self.workers[self._index_of[request.pull.source]]
            pull = PullSource(source.pool, request.pull.end_block)
        dispatch = (self._index_of[worker_id], sim_request, pull, request.origin)
        delay_ms = self.dispatch_delay_ms()
        if delay_ms > 0:
            self.deferred.append((delay_ms, dispatch))
        else:
            self.pending.append(dispatch)
        self._outboxes[sim_request.index] = deque()
        return dispatch

    def _take_back(self, dispatch: _Dispatch) -> None:
        """A sent request aborted before it reached its worker (a redirect)."""
        self.pending = [d for d in self.pending if d is not dispatch]
        self.deferred = [d for d in self.deferred if d[1] is not dispatch]

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
        self._outboxes[request.index].append(
            RequestOutput(request.request_id, (0,), False, "", facts)
        )

    def last_token(self, seq: SimSequence) -> None:
        rid = seq.request.request_id
        self._outboxes.pop(seq.request.index).append(RequestOutput(rid, (0,), True, "length"))


def _read(outbox: deque[RequestOutput]) -> Iterator[RequestOutput]:
    while outbox:
        yield outbox.popleft()


def _read_sent(
    outbox: deque[RequestOutput], take_back: Callable[[], None]
) -> Generator[RequestOutput | None, None, None]:
    """A sent request's outputs after a first None (`send` starts it); closed before its final
    output, the request is taken back if it has not reached its worker."""
    finished = False
    try:
        yield None
        while outbox:
            out = outbox.popleft()
            finished = out.finished
            yield out
    except GeneratorExit:
        if not finished:
            take_back()
        raise
