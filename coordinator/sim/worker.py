"""One simulated engine: the real block pool, a FIFO of routed requests, chunked prefill, steps.

Compute is replaced by `SimCostModel`; the KV bookkeeping is the real `BlockPool`, so what a
worker can match, and what it evicts, is exactly what the live system would do.

    routed -> queue (FIFO) -> admitted: prefix matched, blocks reserved -> [pull] -> prefill
                              (waits while the pool cannot reserve)    first token ^
                                                                              -> decode -> done

* The worker runs steps, like a continuous-batching engine. A decode step produces one token for
  every running sequence and costs `decode_step_ms(batch, context)`, the context being the KV the
  batch reads *at that step* (each sequence's grows by one token per step: `DecodeRun`), plus
  the engine's host time per step (`host_step_ms`, 0 by default).
* One prefill at a time, in arrival order (prefill-first). It runs in chunks of at most
  `chunk_tokens`; a chunk step carries the running decodes too (each gets its token), so it costs
  the chunk's prefill plus one decode step. A long prefill therefore slows every running
  sequence's time per output token, as on a real engine. With `decodes_ride_prefill` off (as
  kvmesh's own engine runs) a chunk step is the prefill's alone and the decodes wait through it.
* With `prefill_batch_tokens` (kvmesh's engine's `max_num_batched_tokens`), the requests queued
  behind the prefilling one join its last step while their new tokens fit the budget left, the
  pool can reserve their blocks and their KV is ready (no pull, no host copy), as the engine's
  scheduler admits every waiting request that fits into one prefill step; they all get their
  first token when the step ends. Without it, one prefill a step.
* The batch changes only at step boundaries: a request that arrives mid-step starts its prefill
  at the next boundary; a sequence leaves at the end of the step that made its last token.
* A planned pull copies the blocks the peer still holds at admission. The copy runs beside the
  decode steps (the engine waits for the KV asynchronously); the prefill of the rest starts at
  the first boundary after it lands. Pulled blocks are registered like computed ones.
* Admission reserves blocks for prompt and output at once (no preemption); prompt blocks are
  registered when the prefill ends, generated blocks when the sequence finishes (when the
  workload knows the tokens a later prompt quotes), then the sequence frees tail-first.
* Like a live worker, it notes each request it takes, prefills and finishes (`NoteLog`), for
  the simulation to deliver to every coordinator replica.
* With warm sessions on, a finished turn's chain is kept warm by the real `WarmSessions`, as the
  live worker does (idle TTL and budget on simulated time); with a host tier, evicted blocks are
  demoted to it and a hit there is priced as a host-to-device copy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.decode_run import BOUNDARY_EPSILON_MS, DecodeRun
from kvmesh.coordinator.sim.host_tier import SimHostTier
from kvmesh.proto.block_hash import BlockHash, num_reusable_tokens
from kvmesh.proto.events import KVEvent
from kvmesh.workers.engine.note_log import NoteLog
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessions

KV_BYTES_PER_TOKEN = 128 << 10
"""A Llama-3-8B token's KV in bf16 (what the cost model is calibrated on): warm-session bytes."""


@dataclass(frozen=True, slots=True, eq=False)
class SimRequest:
    """A workload request, hashed once and replayed against every policy."""

    index: int
    """Position in the workload (arrival order)."""
    request_id: str
    arrival_ms: float
    prompt_len: int
    output_len: int
    session_id: str
    hashes: tuple[BlockHash, ...]
    """Chained hashes of the full blocks of prompt (+ known completion)."""
    num_prompt_blocks: int
    """Full prompt blocks: `hashes[:num_prompt_blocks]` are what the router matches."""
    num_reserved_blocks: int
    """Blocks the sequence occupies at its longest: ceil((prompt + output) / block_size)."""

    @property
    def prompt_hashes(self) -> tuple[BlockHash, ...]:
        return self.hashes[: self.num_prompt_blocks]


@dataclass(frozen=True, slots=True)
class PullSource:
    """Where a routed request should pull its prefix from, and how much of it."""

    pool: BlockPool
    """The peer's pool (read at admission: blocks it evicted meanwhile are not pulled)."""
    num_blocks: int
    """Leading prompt blocks the peer held when the router planned the pull."""


@dataclass(slots=True, eq=False)
class SimSequence:
    """A request admitted on a worker."""

    request: SimRequest
    blocks: list[BlockId]
    num_matched_blocks: int  # leading blocks found in the pool at admission
    cached_tokens: int
    pulled_tokens: int
    admitted_ms: float
    first_token_ms: float = math.nan
    join_step: int = 0  # the worker's step count when its first token came out
    finish_step: int = 0  # ... when its last one does
    host_tokens: int = 0  # of cached_tokens, promoted from the host tier

    @property
    def context_base(self) -> int:
        """Its KV at worker step s is context_base + s (prompt, first token, one per step)."""
        return self.request.prompt_len + 1 - self.join_step


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What happened on a worker at one event time."""

    prefilled: tuple[SimSequence, ...]
    """The sequences whose prefill (and first token) completed: the prefilling one and those
    that rode its last step, in arrival order; empty if none."""
    finished: tuple[SimSequence, ...]
    """Sequences that generated their last token."""


class SimWorker:
    """A simulated engine over a real `BlockPool` (which several lanes may share: the oracle).

    Invariants (checked by `check_invariants`):
      * at most one sequence prefills; a chunk step is in flight only while one does
      * riders (sequences batched into the prefill's last step) exist only while that step runs
      * every running sequence holds its reserved blocks
      * context_base == sum of the decoding sequences' context_base
      * a decode run exists iff sequences decode and no chunk step is in flight
      * busy_ms only grows while a step runs
    """

    def __init__(
        self,
        worker_id: str,
        pool: BlockPool,
        cost: SimCostModel,
        block_size: int,
        root: BlockHash,
        register_on_admit: bool = False,
        sessions: WarmSessionConfig | None = None,
        host_blocks: int = 0,
    ) -> None:
        self.worker_id = worker_id
        # The oracle's lanes share one pool: a prefix counts as reusable as soon as some lane
        # starts computing it, so the bound never loses a hit to two lanes racing.
        self.register_on_admit = register_on_admit
        self.pool = pool
        self.cost = cost
        self.block_size = block_size
        self.root = root
        self.queue: deque[tuple[SimRequest, PullSource | None]] = deque()
        self.prefilling: SimSequence | None = None
        self._riders: list[SimSequence] = []  # batched into the prefilling one's last step
        self._prefill_done = 0  # prompt tokens of `prefilling` whose KV is ready
        self._load_end_ms = 0.0  # its pulled KV has landed by then
        self._chunk_len = 0
        self._chunk_end_ms = math.inf  # the step carrying a prefill chunk ends then
        self._batch: list[tuple[int, int, SimSequence]] = []  # heap by finish step
        self._order = 0
        self.context_base = 0
        self.steps = 0  # steps that made the decoding batch a token (chunk steps, if it rides)
        self._run: DecodeRun | None = None
        self._run_start_step = 0
        self._last_boundary_ms = 0.0
        self._want_ms = 0.0  # the queue's head may start at the first boundary from then
        self._blocked = False  # ... unless it waits for blocks (then a finish wakes it)
        self._last_ms = 0.0
        self.busy_ms = 0.0
        self.epoch = 0  # bumped whenever next_event_ms may have changed
        self.sessions = (
            WarmSessions(
                pool, sessions, block_size * KV_BYTES_PER_TOKEN, lambda: self._last_ms / 1000.0
            )
            if sessions is not None
            else None
        )
        self.host = SimHostTier(host_blocks) if host_blocks else None
        self.notes = NoteLog(worker_id)

    @property
    def num_decoding(self) -> int:
        return len(self._batch)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens queued or prefilling, less what the pool holds of each queued prompt
        (what a live worker reports)."""
        bs = self.block_size
        queued = sum(
            r.prompt_len
            - num_reusable_tokens(r.prompt_len, len(self.pool.match_prefix(r.prompt_hashes)), bs)
            for r, _ in self.queue
        )
        if self.prefilling is not None:
            queued += self.prefilling.request.prompt_len - self.prefilling.cached_tokens
        queued += sum(r.request.prompt_len - r.cached_tokens for r in self._riders)
        return queued

    @property
    def num_requests(self) -> int:
        prefilling = (self.prefilling is not None) + len(self._riders)
        return len(self.queue) + prefilling + len(self._batch)

    def enqueue(
        self, request: SimRequest, pull: PullSource | None = None, origin: str = ""
    ) -> None:
        """Queue a routed request (`origin`: the coordinator that routed it, for the notes)."""
        if request.num_reserved_blocks > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {request.num_reserved_blocks} blocks; "
                f"worker {self.worker_id} has {self.pool.num_blocks}"
            )
        self.queue.append((request, pull))
        n, bs = request.prompt_len, self.block_size
        held = len(self.pool.match_prefix(request.prompt_hashes))
        ready = max(num_reusable_tokens(n, held, bs), self._pullable_tokens(request, pull))
        self.notes.taken(request.request_id, origin, n, n - ready)

    def next_event_ms(self) -> float:
        if self._chunk_end_ms < math.inf:
            return self._chunk_end_ms  # nothing leaves or joins inside a step
        t = math.inf
        if self._run is not None:
            t = self._run.end_of_step_ms(self._batch[0][0] - self._run_start_step)
        if self.prefilling is not None:
            t = min(t, self._boundary_at_or_after(self._load_end_ms))
        elif self.queue and not self._blocked:
            t = min(t, self._boundary_at_or_after(self._want_ms))
        return t

    def advance(self, now_ms: float) -> StepOutcome:
        """Bring the worker to `now_ms` (a step boundary): end the chunk step and the sequences
        due by then, and start the next chunk when the prefill's KV is ready."""
        self._sync(now_ms)
        prefilled: tuple[SimSequence, ...] = ()
        if self._chunk_end_ms <= now_ms + BOUNDARY_EPSILON_MS:
            self._chunk_end_ms = math.inf
            if self.cost.decodes_ride_prefill:
                self.steps += 1  # the batch got its token
            self._prefill_done += self._chunk_len
            seq = self.prefilling
            assert seq is not None
            if self._prefill_done >= seq.request.prompt_len:
                self.prefilling, prefilled = None, (seq, *self._riders)
                self._riders = []
                for done in prefilled:
                    self._join(done, now_ms)
                    self.notes.prefilled(done.request.request_id)
        finished = self._retire()
        self._rebase(now_ms)
        self._maybe_start_chunk(now_ms)
        self.epoch += 1
        return StepOutcome(prefilled, finished)

    def try_admit(self, now_ms: float) -> SimSequence | None:
        """Start the next queued prefill if the worker is at a step boundary, has no prefill
        running and the pool can reserve the request's blocks."""
        self._sync(now_ms)
        if self.sessions is not None:
            self.sessions.expire()
        if self.prefilling is not None or not self.queue:
            return None
        request, pull = self.queue[0]
        pool = self.pool
        matched = pool.match_prefix(request.prompt_hashes)
        need = request.num_reserved_blocks - len(matched)
        reclaimed = sum(1 for b in matched if pool.ref_count(b) == 0)
        if need > pool.num_free - reclaimed:
            self._set_waiting(now_ms, blocked=True)
            return None  # expected: wait for a running sequence to free its blocks
        if self._run is not None and now_ms - self._last_boundary_ms > BOUNDARY_EPSILON_MS:
            self._set_waiting(now_ms, blocked=False)
            return None  # mid-step: the prefill joins at the next boundary
        self.queue.popleft()
        self._blocked = False
        pool.acquire(matched)
        fresh = pool.allocate(need)
        assert fresh is not None
        self._demote_evicted()
        n, bs = request.prompt_len, self.block_size
        cached = num_reusable_tokens(n, len(matched), bs)
        host_ready = cached
        if self.host is not None:
            num_host = self.host.match(request.prompt_hashes[len(matched) :])
            host_ready = num_reusable_tokens(n, len(matched) + num_host, bs)
        pulled_ready = self._pullable_tokens(request, pull)
        ready = max(cached, pulled_ready, host_ready)
        seq = SimSequence(request, matched + fresh, len(matched), cached, ready - cached, now_ms)
        if host_ready >= pulled_ready and host_ready > cached:  # promoted, not pulled
            seq.cached_tokens, seq.pulled_tokens = host_ready, 0
            seq.host_tokens = host_ready - cached
        self.prefilling, self._prefill_done = seq, ready
        self._load_end_ms = now_ms + self.cost.transfer_ms(ready - cached)
        if self.register_on_admit:
            self._register(seq, seq.num_matched_blocks, request.num_prompt_blocks)
        self._rebase(now_ms)
        self._maybe_start_chunk(now_ms)
        self.epoch += 1
        return seq

    def _set_waiting(self, now_ms: float, blocked: bool) -> None:
        if (self._blocked, self._want_ms) != (blocked, now_ms):
            self._blocked, self._want_ms = blocked, now_ms
            self.epoch += 1

    def _pullable_tokens(self, request: SimRequest, pull: PullSource | None) -> int:
        """Prompt tokens available after the pull: what the peer still holds of the plan."""
        if pull is None:
            return 0
        held = len(pull.pool.match_prefix(request.prompt_hashes[: pull.num_blocks]))
        return num_reusable_tokens(request.prompt_len, held, self.block_size)

    def _sync(self, now_ms: float) -> None:
        """Count the busy time and the decode steps finished since the last look."""
        elapsed = now_ms - self._last_ms
        if elapsed <= 0:
            return
        if self._run is not None or self._chunk_end_ms < math.inf:
            self.busy_ms += elapsed
        if self._run is not None:
            done = self._run.steps_done_by(now_ms)
            self.steps = self._run_start_step + done
            self._last_boundary_ms = self._run.end_of_step_ms(done)
        elif self._chunk_end_ms == math.inf:
            self._last_boundary_ms = now_ms  # idle: any time is a boundary
        self._last_ms = now_ms

    def _boundary_at_or_after(self, t_ms: float) -> float:
        return t_ms if self._run is None else self._run.boundary_at_or_after(t_ms)

    def _rebase(self, now_ms: float) -> None:
        """The batch may have changed at this boundary: time the next run of decode steps."""
        self._last_boundary_ms = self._last_ms = now_ms
        if self._batch and self._chunk_end_ms == math.inf:
            cost = self.cost
            self._run = DecodeRun(
                now_ms,
                cost.decode_step_ms(len(self._batch), 0),
                cost.decode_per_context_token_ms,
                self._batch_context(),
                len(self._batch),
            )
            self._run_start_step = self.steps
        else:
            self._run = None

    def _batch_context(self) -> int:
        return self.context_base + len(self._batch) * self.steps

    def _maybe_start_chunk(self, now_ms: float) -> None:
        seq = self.prefilling
        if seq is None or self._chunk_end_ms < math.inf:
            return
        if self._load_end_ms > now_ms + BOUNDARY_EPSILON_MS:
            return  # the pull has not landed: decode steps go on meanwhile
        self._chunk_len = min(self.cost.chunk_tokens, seq.request.prompt_len - self._prefill_done)
        last_step = self._prefill_done + self._chunk_len >= seq.request.prompt_len
        if last_step and self.cost.prefill_batch_tokens:
            self._take_riders(now_ms, self.cost.prefill_batch_tokens - self._chunk_len)
        riders = self._riders
        if riders:
            chunks = [(self._chunk_len, self._prefill_done)]
            chunks += [(r.request.prompt_len - r.cached_tokens, r.cached_tokens) for r in riders]
            duration = self.cost.prefill_batch_step_ms(chunks)
        else:
            duration = self.cost.chunk_step_ms(
                self._chunk_len, self._prefill_done, len(self._batch), self._batch_context()
            )
        self._chunk_end_ms = now_ms + duration
        self._run = None

    def _take_riders(self, now_ms: float, budget_tokens: int) -> None:
        """Admit the queued requests that fit the step's budget, in order, stopping at the first
        that does not (too many new tokens, blocks the pool cannot reserve, KV not ready): the
        engine's scheduler admits a prefix of its queue the same way."""
        pool, bs = self.pool, self.block_size
        while self.queue:
            request, pull = self.queue[0]
            if pull is not None and self._pullable_tokens(request, pull) > 0:
                return  # its KV comes over a link: it prefills in a step of its own
            matched = pool.match_prefix(request.prompt_hashes)
            if self.host is not None and self.host.match(request.prompt_hashes[len(matched) :]):
                return  # part of its KV is on the host: copied before its step
            cached = num_reusable_tokens(request.prompt_len, len(matched), bs)
            if request.prompt_len - cached > budget_tokens:
                return
            need = request.num_reserved_blocks - len(matched)
            reclaimed = sum(1 for b in matched if pool.ref_count(b) == 0)
            if need > pool.num_free - reclaimed:
                return
            self.queue.popleft()
            pool.acquire(matched)
            fresh = pool.allocate(need)
            assert fresh is not None
            self._demote_evicted()
            rider = SimSequence(request, matched + fresh, len(matched), cached, 0, now_ms)
            if self.register_on_admit:
                self._register(rider, rider.num_matched_blocks, request.num_prompt_blocks)
            self._riders.append(rider)
            budget_tokens -= request.prompt_len - cached

    def _join(self, seq: SimSequence, now_ms: float) -> None:
        request = seq.request
        if not self.register_on_admit:
            self._register(seq, seq.num_matched_blocks, request.num_prompt_blocks)
        seq.first_token_ms = now_ms
        seq.join_step = self.steps
        seq.finish_step = self.steps + request.output_len - 1
        heapq.heappush(self._batch, (seq.finish_step, self._order, seq))
        self._order += 1
        self.context_base += seq.context_base

    def _retire(self) -> tuple[SimSequence, ...]:
        finished = []
        while self._batch and self._batch[0][0] <= self.steps:
            _, _, seq = heapq.heappop(self._batch)
            self.context_base -= seq.context_base
            self._register(seq, seq.request.num_prompt_blocks, len(seq.request.hashes))
            self.pool.free(seq.blocks)
            if self.sessions is not None:
                chain = self.pool.match_prefix(seq.request.hashes)
                self.sessions.keep(seq.request.session_id, chain)
            finished.append(seq)
            self.notes.finished(seq.request.request_id)
        if finished:
            self._blocked = False
        return tuple(finished)

    def _demote_evicted(self) -> None:
        evicted = self.pool.drain_evicted()
        if self.host is not None and evicted:
            self.host.put([h for _b, h in evicted])

    def drain_events(self) -> list[KVEvent]:
        """The pool's KV events, then the host tier's."""
        events = self.pool.drain_events()
        if self.host is not None:
            events += self.host.drain_events()
        return events

    def _register(self, seq: SimSequence, start: int, stop: int) -> None:
        hashes = seq.request.hashes
        for i in range(start, min(stop, len(seq.blocks))):
            self.pool.register(seq.blocks[i], hashes[i], hashes[i - 1] if i else self.root)

    def check_invariants(self) -> None:
        assert self.context_base == sum(s.context_base for _, _, s in self._batch)
        assert self._chunk_end_ms == math.inf or self.prefilling is not None
        assert not self._riders or self._chunk_end_ms < math.inf
        for rider in self._riders:
            assert all(self.pool.ref_count(b) > 0 for b in rider.blocks)
        assert (self._run is not None) == (bool(self._batch) and self._chunk_end_ms == math.inf)
        for _, _, seq in self._batch:
            assert all(self.pool.ref_count(b) > 0 for b in seq.blocks)
        if self.prefilling is not None:
            assert all(self.pool.ref_count(b) > 0 for b in self.prefilling.blocks)
        if self.sessions is not None:
            self.sessions.sync()
            self.sessions.check_invariants()
