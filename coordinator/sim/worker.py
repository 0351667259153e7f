"""One simulated engine: the real block pool, a FIFO of routed requests, prefill, a decode batch.

Compute is replaced by `SimCostModel`; the KV bookkeeping is the real `BlockPool`, so what a
worker can match, and what it evicts, is exactly what the live system would do.

    routed -> queue (FIFO) -> admitted: prefix matched, blocks reserved -> prefill -> decode -> done
                              (waits while the pool cannot reserve)     first token ^

* One prefill at a time, in arrival order (prefill-first continuous batching). A prefill of n new
  tokens runs in ceil(n / chunk_tokens) steps and the running decodes ride along each step, so
  decoding keeps going (one token per chunk) and each chunk costs one decode step more.
* Between prefills the batch decodes at one token per `decode_step_ms(batch, context)`.
  Decode progress is tracked as a fluid step counter: a sequence finishes when the counter passes
  the step it joined at plus its output length. The rate is piecewise constant between events,
  so the next event time is exact and the simulation never iterates over single tokens.
* Admission reserves blocks for prompt and output at once (no preemption); prompt blocks are
  registered when the prefill ends, generated blocks when the sequence finishes (when the
  workload knows the tokens a later prompt quotes), then the sequence frees tail-first.
* A planned pull copies the blocks the peer still holds at admission, priced by the cost model's
  transfer time before the prefill; pulled blocks are registered like computed ones.
* With warm sessions on, a finished turn's chain is kept warm by the real `WarmSessions`, as the
  live worker does (idle TTL and budget on simulated time).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.host_tier import SimHostTier
from kvmesh.proto.block_hash import BlockHash, num_reusable_tokens
from kvmesh.proto.events import KVEvent
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessions

KV_BYTES_PER_TOKEN = 128 << 10
"""A Llama-3-8B token's KV in bf16 (what the cost model is calibrated on): warm-session bytes."""

_STEP_EPSILON = 1e-6


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
    prompt_ids: np.ndarray | None = None
    """The prompt's token ids (the coordinator is handed them; hashes above are the truth)."""

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
    context_tokens: int  # KV the sequence attends to while decoding (prompt + half its output)
    finish_step: float = 0.0
    host_tokens: int = 0  # of cached_tokens, promoted from the host tier


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What happened on a worker at one event time."""

    prefilled: SimSequence | None
    """The sequence whose prefill (and first token) completed, if any."""
    finished: tuple[SimSequence, ...]
    """Sequences that generated their last token."""


class SimWorker:
    """A simulated engine over a real `BlockPool` (which several lanes may share: the oracle).

    Invariants (checked by `check_invariants`):
      * at most one sequence prefills; every running sequence holds its reserved blocks
      * batch_context == sum of context_tokens of the decoding sequences
      * busy_ms only grows while something prefills or decodes
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
        self.prefill_end_ms = math.inf
        self._batch: list[tuple[float, int, SimSequence]] = []  # heap by finish step
        self._order = 0
        self.batch_context = 0
        self.steps = 0.0
        self._rate = 0.0  # decode steps per ms
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
        return queued

    @property
    def num_requests(self) -> int:
        return len(self.queue) + (self.prefilling is not None) + len(self._batch)

    def enqueue(self, request: SimRequest, pull: PullSource | None = None) -> None:
        if request.num_reserved_blocks > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {request.num_reserved_blocks} blocks; "
                f"worker {self.worker_id} has {self.pool.num_blocks}"
            )
        self.queue.append((request, pull))

    def next_event_ms(self) -> float:
        t = self.prefill_end_ms if self.prefilling is not None else math.inf
        if self._batch and self._rate > 0:
            t = min(t, self._last_ms + max(0.0, self._batch[0][0] - self.steps) / self._rate)
        return t

    def advance(self, now_ms: float) -> StepOutcome:
        """Bring the worker to `now_ms`, completing the prefill and the sequences due by then."""
        self._progress(now_ms)
        prefilled = None
        finished: list[SimSequence] = []
        if self.prefilling is not None and self.prefill_end_ms <= now_ms:
            prefilled, self.prefilling, self.prefill_end_ms = self.prefilling, None, math.inf
            request = prefilled.request
            if not self.register_on_admit:
                self._register(prefilled, prefilled.num_matched_blocks, request.num_prompt_blocks)
            prefilled.finish_step = self.steps + request.output_len - 1
            heapq.heappush(self._batch, (prefilled.finish_step, self._order, prefilled))
            self._order += 1
            self.batch_context += prefilled.context_tokens
        while self._batch and self._batch[0][0] <= self.steps + _STEP_EPSILON:
            _, _, seq = heapq.heappop(self._batch)
            self.batch_context -= seq.context_tokens
            self._register(seq, seq.request.num_prompt_blocks, len(seq.request.hashes))
            self.pool.free(seq.blocks)
            if self.sessions is not None:
                chain = self.pool.match_prefix(seq.request.hashes)
                self.sessions.keep(seq.request.session_id, chain)
            finished.append(seq)
        self._update_rate()
        return StepOutcome(prefilled, tuple(finished))

    def try_admit(self, now_ms: float) -> SimSequence | None:
        """Start the next queued prefill if the worker is free and the pool can reserve it."""
        self._progress(now_ms)
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
            return None  # expected: wait for a running sequence to free its blocks
        self.queue.popleft()
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
        context = n + request.output_len // 2
        seq = SimSequence(
            request, matched + fresh, len(matched), cached, ready - cached, now_ms, context
        )
        if host_ready >= pulled_ready and host_ready > cached:  # promoted, not pulled
            seq.cached_tokens, seq.pulled_tokens = host_ready, 0
            seq.host_tokens = host_ready - cached
        duration = self.cost.transfer_ms(ready - cached) + self.cost.prefill_ms(n - ready, ready)
        if self._batch:
            chunks = self.cost.num_chunks(n - ready)
            duration += chunks * self.cost.decode_step_ms(len(self._batch), self.batch_context)
            self._rate = chunks / duration
        self.prefilling, self.prefill_end_ms = seq, now_ms + duration
        if self.register_on_admit:
            self._register(seq, seq.num_matched_blocks, request.num_prompt_blocks)
        self._update_rate()
        return seq

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

    def _pullable_tokens(self, request: SimRequest, pull: PullSource | None) -> int:
        """Prompt tokens available after the pull: what the peer still holds of the plan."""
        if pull is None:
            return 0
        held = len(pull.pool.match_prefix(request.prompt_hashes[: pull.num_blocks]))
        return num_reusable_tokens(request.prompt_len, held, self.block_size)

    def _progress(self, now_ms: float) -> None:
        elapsed = now_ms - self._last_ms
        if elapsed > 0:
            if self.prefilling is not None or self._batch:
                self.busy_ms += elapsed
            self.steps += self._rate * elapsed
            self._last_ms = now_ms

    def _update_rate(self) -> None:
        if self.prefilling is None:
            step_ms = self.cost.decode_step_ms(len(self._batch), self.batch_context)
            self._rate = 1.0 / step_ms if self._batch and step_ms > 0 else 0.0
        elif not self._batch:
            self._rate = 0.0
        # while prefilling with a batch, the rate set at admission (one step per chunk) holds
        self.epoch += 1

    def _register(self, seq: SimSequence, start: int, stop: int) -> None:
        hashes = seq.request.hashes
        for i in range(start, min(stop, len(seq.blocks))):
            self.pool.register(seq.blocks[i], hashes[i], hashes[i - 1] if i else self.root)

    def check_invariants(self) -> None:
        assert self.batch_context == sum(s.context_tokens for _, _, s in self._batch)
        for _, _, seq in self._batch:
            assert all(self.pool.ref_count(b) > 0 for b in seq.blocks)
        if self.prefilling is not None:
            assert all(self.pool.ref_count(b) > 0 for b in self.prefilling.blocks)
        if self.sessions is not None:
            self.sessions.sync()
            self.sessions.check_invariants()
