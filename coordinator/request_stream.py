"""One routed request's outputs as stream events, through its worker's death: a request whose
worker dies mid-stream moves to another live worker with its prompt plus the tokens already
streamed (at most `max_migrations` times), keeping its session, so the client sees a slower
stream, not an error. When the stream ends, however it ends, the coordinator's load tracker,
policy and counters let go of the request and its observers get one `RequestRecord`.

    outputs (worker A) --> events --> A dies --> re-route the rest --> outputs (worker B) ...
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from kvmesh.coordinator.contract import WorkerDied
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.session_turns import TurnMode
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.coordinator.telemetry.request_record import finished_record
from kvmesh.workers.contract.replies import (
    PrefillFacts,
    RequestOutput,
    RequestRejected,
    WorkerFailed,
)
from kvmesh.workers.contract.requests import WorkerRequest

if TYPE_CHECKING:
    from kvmesh.coordinator.coordinator import Coordinator


class RequestStream:
    """Invariant: `current` is the request the worker now serving it runs (the original, or its
    latest migration, whose id ends `.m<n>`); `produced` every token the client has been given."""

    def __init__(
        self,
        coordinator: Coordinator,
        worker: WorkerId,
        request: WorkerRequest,
        outputs: Iterator[RequestOutput],
        *,
        started: float | None = None,
        label: str = "",
    ) -> None:
        self.coordinator = coordinator
        self.worker = worker
        self.request = request
        self.current = request
        self.outputs = outputs
        self.started = started
        self.label = label
        self.produced: list[int] = []
        self.migrations = 0
        self.dead: set[str] = set()  # workers that died serving it

    def events(self, *, count_turn: bool = True) -> Generator[StreamEvent, bool | None, None]:
        """The worker's outputs as stream events. `count_turn`: count it among its session's
        turns in flight (an exclusive turn was counted before it was routed). A consumer that
        has what it asked for before the worker finished (a stop string) sends True: the stream
        ends as finished, the worker stops; closing it instead is a cancel."""
        c, request = self.coordinator, self.request
        if count_turn:
            c.turns.begin(request.session_id, TurnMode.CONCURRENT)
        ok = cancelled = False
        first_at: float | None = None
        prefills: list[PrefillFacts] = []
        reason = ""
        try:
            while True:
                try:
                    for event in self._worker_events():
                        self.produced.extend(event.token_ids)
                        if first_at is None:
                            first_at = c.clock()
                        if event.prefill is not None:
                            prefills.append(event.prefill)
                        # Finished once the final event is out: a consumer may close the stream
                        # as soon as it has read it (the OpenAI front door does).
                        ok = ok or event.finished
                        done_early = yield event
                        if event.finished:
                            return
                        if done_early:
                            ok = True
                            return
                    return  # the worker's stream ended without a final output
                except WorkerDied:
                    self.migrations += 1
                    if self.migrations > c.config.max_migrations:
                        raise
                    self.worker, self.current = self._migrate()
                    self.outputs = c.backend.generate(self.worker, self.current)
        except GeneratorExit:  # the consumer went away: a cancel, not a failure (unless done)
            cancelled = not ok
            raise
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            raise
        finally:
            if count_turn:
                c.turns.end(request.session_id)
            with c.lock:
                c.load.on_finished(self.current.request_id)
                c.policy.on_request_done(self.current.request_id)
                if self.current is not request:
                    c.policy.on_request_done(request.request_id)
                if cancelled:
                    c.counters.num_cancelled_requests += 1
                elif not ok:
                    c.counters.num_failed_requests += 1
            if c.observers:
                outcome = "ok" if ok else "cancelled" if cancelled else "failed"
                ttft = None if first_at is None or self.started is None else first_at - self.started
                record = finished_record(
                    request, self.label, outcome, self.worker, ttft, prefills, self.produced
                )
                c.notify(replace(record, num_migrations=self.migrations, reason=reason))

    def _worker_events(self) -> Iterator[StreamEvent]:
        c, worker = self.coordinator, self.worker
        for out in self.outputs:
            if out.failure is not None:  # this request alone failed; the worker serves on
                if out.failure.internal:
                    raise WorkerFailed(f"worker {worker}: {out.failure.message}")
                raise RequestRejected(out.failure.message)
            if out.prefill is not None:
                self._on_prefilled(out.prefill)
            with c.lock:
                c.counters.generated_tokens += len(out.new_token_ids)
            yield StreamEvent(
                out.new_token_ids, worker, out.finished, out.finish_reason, out.prefill
            )

    def _migrate(self) -> tuple[WorkerId, WorkerRequest]:
        """Re-route what is left of the original request after its worker died."""
        c, dead, original = self.coordinator, self.worker, self.request
        self.dead.add(dead)
        with c.lock:
            c.load.forget_worker(dead)
            c.peer_routes.forget_worker(dead)
            c.counters.num_migrations += 1
        remaining = original.sampling.max_tokens - len(self.produced)
        if remaining < 1:
            raise WorkerDied(dead)  # nothing left to generate but the final message was lost
        prompt = c.prompts.prepare(
            list(original.prompt_ids) + self.produced,
            "",
            original.cache_salt,
            bypass_cache=original.bypass_cache,
            adapter=original.adapter,
        )
        request_id = f"{original.request_id}.m{self.migrations}"
        # Never back to a worker that died under it: the registry hears of a death later than
        # the stream does. Raises NoLiveWorker if none is left; the session's affinity moves.
        decision = c.route(
            prompt,
            original.session_id,
            request_id,
            remaining,
            commit=True,
            avoid=frozenset(self.dead),
        )
        with c.lock:
            uncached = c.uncached_tokens(len(prompt.token_ids), decision.matched_blocks)
            c.load.on_routed(
                request_id, decision.worker_id, decision.predicted_prefill_ms, uncached
            )
        sampling = replace(original.sampling, max_tokens=remaining)
        return decision.worker_id, WorkerRequest(
            request_id,
            prompt.token_ids,
            sampling,
            original.cache_salt,
            session_id=original.session_id,
            bypass_cache=original.bypass_cache,
            adapter=original.adapter,
            origin=c.origin,
            sent_at_s=time.time(),
        )

    def _on_prefilled(self, facts: PrefillFacts) -> None:
        c, worker, request = self.coordinator, self.worker, self.current
        if request.pull is not None and c.transfers is not None:
            c.transfers.observe(request.pull.source, worker, facts)
        with c.lock:
            c.load.on_prefilled(request.request_id)
            c.counters.on_prefilled(worker, facts)
