"""The worker's logic, without Ray: requests in, tokens and KV events out.

The actor shell (actor.py) owns the threads, Ray and the transports; this class owns the pool,
the scheduler and the model runner, and is driven by `step()` and by calls the shell makes on the
engine thread. Time comes from the injected clock. What crosses to the coordinator is the
contract (`kvmesh.workers.contract`).

A request with a pull plan is accepted in steps (`pull_admission` holds it meanwhile), so the
worker owns the pulled KV from the first moment (the other side of a pull, serving a peer, is
`pull_source`):

    add_request(req)  -> PullReservation   local prefix pinned, blocks for the rest allocated
    write_pull(id, fill)                     the transport writes the reserved blocks
    finish_pull(id, n)                       n blocks registered, the prefix pinned for the
                                             request, which now waits for admission
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from dataclasses import replace

import torch

from kvmesh.proto.block_hash import BlockHash, namespace_hash, prompt_root
from kvmesh.proto.events import EventBatch
from kvmesh.proto.request_notes import NoteBatch
from kvmesh.workers.contract.replies import (
    CacheStats,
    RequestOutput,
    SequenceFailure,
    WorkerCounters,
    WorkerInfo,
)
from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.engine.decode_pipeline import DecodePipeline
from kvmesh.workers.engine.event_log import EventLog
from kvmesh.workers.engine.failure import forward_and_sample
from kvmesh.workers.engine.host_tier import HostTier
from kvmesh.workers.engine.note_log import NoteLog
from kvmesh.workers.engine.prefill_backlog import PrefillBacklog
from kvmesh.workers.engine.pull_admission import (
    BlockWriter,
    PullAdmission,
    PullTargets,
    PullTiming,
)
from kvmesh.workers.engine.pull_source import PullSource
from kvmesh.workers.engine.request_checks import check_request
from kvmesh.workers.engine.sampler import NON_FINITE, failure_of
from kvmesh.workers.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig, StepKind
from kvmesh.workers.engine.sequence import SeqStatus, Sequence
from kvmesh.workers.engine.state_lock import StateLock
from kvmesh.workers.engine.tally import WorkerTally
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.kv.pull_reservation import PullReservation
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessions
from kvmesh.workers.model.runner import ModelRunner, SeqChunk

__all__ = ["BlockWriter", "PullTargets", "Worker"]

log = logging.getLogger(__name__)


class Worker:
    """One GPU's (or CPU's) engine: block pool + scheduler + model runner.

    Invariants: the pool's cached hashes are exactly what the published events say it holds
    (stored minus removed since the last AllCleared of this generation); every pool reference is
    held by a running sequence's block table, a waiting sequence's pins, a pending pull's
    reservation, a run pinned for a peer or a queued decode step (`decode_pipeline`;
    `check_invariants` verifies all of it).
    """

    def __init__(
        self,
        worker_id: str,
        runner: ModelRunner,
        model_fingerprint: str,
        scheduler_config: SchedulerConfig,
        *,
        eos_token_ids: Seq[int] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        device: str = "cpu",
        logits_sink: Callable[[str, torch.Tensor], None] | None = None,
        host_pool: HostPool | None = None,
        sessions: WarmSessionConfig | None = None,
        prefix_cache: bool = True,
        cache_epoch: int = 0,
        pipelined_decode: bool = False,
    ) -> None:
        """`pipelined_decode`: decode steps are queued one ahead of the host (`decode_pipeline`;
        worth it where the runner replays CUDA graphs)."""
        self.worker_id = worker_id
        self.runner = runner
        self.model_fingerprint = model_fingerprint
        # Redis key namespace: one per model, shared by all its tenants (salts live in the hashes).
        self.namespace = f"{namespace_hash(model_fingerprint):016x}"
        self.device = device
        self.prefix_cache = prefix_cache
        """False (`--no-prefix-cache`): every request runs as if it asked for `bypass_cache`."""
        self.cache_epoch = cache_epoch
        """Part of every root hash; `clear_cache` moves it on (see `cache_root`)."""
        self.kv_dtype = str(runner.kv_cache.dtype).removeprefix("torch.")
        self.node = socket.gethostname()
        """Where the worker runs; the Ray shell names its Ray node, so two raylets on one
        host are two nodes (pulls between them are priced as between nodes)."""
        self.clock = clock
        self.wall_clock = wall_clock
        """`time.time()`'s clock, against which a coordinator stamps `sent_at_s`."""
        self.pool = BlockPool(runner.num_blocks, run_blocks=runner.page_run_blocks)
        self.host_pool = host_pool
        # A cached tail still being written (a pull, a promotion) is read in place, not copied.
        block_io = runner.block_io
        # A protected block a copy takes over renames one warm session's chain, not many.
        self.scheduler = Scheduler(
            scheduler_config,
            self.pool,
            can_relocate=lambda blocks: not block_io.writing(blocks),
            protected_may_move=lambda block: self.sessions.kept_by_one(block),
        )
        self.block_size = scheduler_config.block_size
        self.host_tier = HostTier(host_pool, self.pool, runner, self.block_size)
        # Warm sessions run on the clock in seconds, whatever unit the pool's clock uses.
        self.sessions = WarmSessions(
            self.pool, sessions or WarmSessionConfig(), self.block_num_bytes, clock
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.events = EventLog(worker_id, self.pool, host_pool)
        self.notes = NoteLog(worker_id)
        self._seqs: dict[str, Sequence] = {}
        self.pulls = PullAdmission(self.pool, self.host_tier, self.block_size)
        """The target side of pulls: requests whose pulled KV is being written."""
        self.pull_source = PullSource(worker_id, self.pool, runner, self.host_tier)
        """The source side: blocks exported to peers, or pinned for them to copy in place."""
        self.backlog = PrefillBacklog(self.pool, self.scheduler, self.pulls, self.block_size)
        self.state_lock: StateLock | None = None
        """Set by the engine thread that owns this worker (`workers/engine/state_lock.py`): a
        step's forward pass runs with it released, so a peer's pin need not wait for the step."""
        self.tally = WorkerTally()
        self.decode_pipeline = (
            DecodePipeline(runner, self.pool, self.block_size) if pipelined_decode else None
        )
        # Debug / test hook: receives (request_id, logits row) for every sampled token.
        self._logits_sink = logits_sink

    def root_hash(self, cache_salt: str = "", adapter: str = "") -> BlockHash:
        return prompt_root(
            self.model_fingerprint, cache_salt, self.kv_dtype, self.cache_epoch, adapter
        )

    @property
    def has_work(self) -> bool:
        """Requests to run, or a queued decode step still to land."""
        pipeline = self.decode_pipeline
        return self.scheduler.has_work or (pipeline is not None and pipeline.queued is not None)

    @property
    def block_num_bytes(self) -> int:
        return self.runner.block_io.block_num_bytes

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self, req: WorkerRequest, accepted_s: float | None = None
    ) -> PullReservation | None:
        """Accept a request. With a pull plan that this worker can still use, returns the
        reservation the transport fills; the request then waits for `finish_pull`.
        `accepted_s`: when the worker's shell took it (this worker's clock; default now), before
        it waited for the engine to finish its step: its queueing counts from then."""
        if req.request_id in self._seqs:
            raise ValueError("a request with this id is already running on this worker")
        prompt_ids = check_request(req, self.runner.config, self.runner.adapters)
        now = self.clock()
        accepted = now if accepted_s is None else min(accepted_s, now)
        seq = Sequence(
            req.request_id,
            prompt_ids,
            req.sampling,
            self.root_hash(req.cache_salt, req.adapter),
            accepted,
            session_id=req.session_id,
            adapter=req.adapter,
            bypass_cache=req.bypass_cache or not self.prefix_cache,
            cache_salt=req.cache_salt,
        )
        self.scheduler.check_fits(seq)
        if req.sent_at_s > 0:  # the wall clock when it was accepted, against the coordinator's
            sent_ago_s = self.wall_clock() - req.sent_at_s
            seq.dispatch_ms = max(0.0, (sent_ago_s - (now - accepted)) * 1e3)
        self._seqs[req.request_id] = seq
        self.tally.num_requests += 1
        pull = req.pull if not seq.bypass_cache else None
        reservation = self.pulls.reserve(seq, pull) if pull is not None else None
        if reservation is None:  # no plan, or one this prompt cannot use: recompute
            self.scheduler.add(seq)
        self.backlog.update()
        uncached_len = self.backlog.uncached_len(seq, pull)
        self.notes.taken(req.request_id, req.origin, seq.num_tokens, uncached_len)
        return reservation

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if not self.pulls.release(request_id):
            self.scheduler.abort(request_id)
        self.backlog.update()
        self.notes.finished(request_id)
        return True

    # ---- pulls (target side) --------------------------------------------------------------------

    def write_pull(self, request_id: str, fill: BlockWriter) -> int:
        """Run a transport's writer over the request's reserved blocks (see `PullAdmission`)."""
        return self.pulls.write(request_id, fill)

    def finish_pull(self, request_id: str, num_written: int, timing: PullTiming) -> int:
        """Register what the transport wrote and queue the request; returns pulled blocks."""
        finished = self.pulls.finish(request_id, num_written, timing, self.block_num_bytes)
        if finished is None:
            return 0  # aborted while pulling: abort released the reservation
        seq, num_pulled = finished
        self.tally.num_pulls += 1
        self.tally.num_failed_pulls += num_pulled == 0
        self.scheduler.add(seq)
        self.backlog.update()
        return num_pulled

    def write_back_host(self, look_ahead: int) -> int:
        """Idle work: copy some of the device pool's next `look_ahead` evictions to the host
        tier ahead of time (`HostTier.write_back`); returns blocks copied (0: nothing to do)."""
        return self.host_tier.write_back(look_ahead)

    # ---- steps --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns what each touched request produced."""
        outputs = self._step()
        self.backlog.update()
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            return self._run_step()
        finally:
            self.host_tier.end_step()

    def _run_step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        self.sessions.expire()
        if self.decode_pipeline is not None and self.decode_pipeline.queued is not None:
            return self._land_queued(began)
        waiting = list(self.scheduler.waiting)[: self.scheduler.config.max_num_seqs]
        self.tally.host_hit_tokens += self.host_tier.promote(waiting, self.scheduler.unpin)
        step = self.scheduler.schedule()
        self.host_tier.demote_evicted()  # before the forward pass overwrites the reallocated blocks
        if step is None:
            return []
        # Cached tails into their runs (after the demotions have read the blocks they overwrite).
        for seq in step.seqs:
            if seq.relocated:
                first = seq.num_registered_blocks
                copies = seq.block_table[first : first + len(seq.relocated)]
                self.runner.block_io.copy_within(seq.relocated, copies)
        prefill, num_seqs = step.kind is StepKind.PREFILL, len(step.seqs)
        now = self.clock()
        for seq in step.seqs:
            if seq.prefill_started_s is None:
                seq.prefill_started_s = now
        pipeline = self.decode_pipeline
        if pipeline is not None and self._queues(step):
            try:
                pipeline.launch(step)
            except Exception:  # the forward below runs it, failing only what fails alone
                log.exception("queueing a decode step failed; it runs synchronously")
            else:
                return self._land_queued(began)
        started = time.perf_counter()
        chunks = [
            SeqChunk(seq.ids_from(start), start, seq.block_table, adapter=seq.adapter)
            for seq, start in zip(step.seqs, step.start_positions, strict=True)
        ]
        with self.state_lock.released() if self.state_lock is not None else nullcontext():
            results = forward_and_sample(self.runner.forward, step.seqs, chunks, self._logits_sink)
        if step.kind is StepKind.PREFILL:
            self.tally.prefill_ms_total += (time.perf_counter() - started) * 1e3
            self.tally.prefill_tokens_total += sum(len(c.token_ids) for c in chunks)
        failed = [
            (seq, r) for seq, r in zip(step.seqs, results, strict=True) if not isinstance(r, int)
        ]
        sampled = [r for r in results if isinstance(r, int)]
        if failed:
            step = self._without_failed(step, [seq for seq, _ in failed])
        self.scheduler.on_step_done(step, sampled, self.eos_token_ids)
        outputs = self._outputs(step, sampled) + [self._fail(seq, f) for seq, f in failed]
        self.tally.on_step(prefill, num_seqs, (time.perf_counter() - began) * 1e3)
        return outputs

    def _queues(self, step: ScheduledStep) -> bool:
        """Whether this step goes through the decode pipeline (not with the logits hook, which
        wants every step's logits)."""
        return self._logits_sink is None and DecodePipeline.takes(step)

    def _land_queued(self, began: float) -> list[RequestOutput]:
        """Queue the next decode step behind the queued one where the batch goes on
        (`DecodePipeline.next_step`), then read the queued one's tokens: its outputs."""
        pipeline = self.decode_pipeline
        assert pipeline is not None
        landing = pipeline.take()
        try:
            following = None if self.scheduler.waiting else pipeline.next_step()
            if following is not None:
                self.host_tier.demote_evicted()  # before the step overwrites reallocated blocks
                try:
                    pipeline.launch(following, behind=landing)
                except Exception:  # the scheduler schedules it again once this one has landed
                    log.exception("queueing a decode step behind another failed")
            with self.state_lock.released() if self.state_lock is not None else nullcontext():
                tokens = landing.tokens.tolist()
            undrawn = {id(landing.step.seqs[row]) for row in landing.tokens.failed_rows()}
        except BaseException:  # the engine fails the running requests; the pool stays whole
            pipeline.drop()
            raise
        step, sampled = pipeline.land(tokens)
        if not step.seqs:
            return []
        failed = [seq for seq in step.seqs if id(seq) in undrawn]
        if failed:  # as `sample_isolated` fails such a row: that request alone
            sampled = [
                t for seq, t in zip(step.seqs, sampled, strict=True) if id(seq) not in undrawn
            ]
            step = self._without_failed(step, failed)
        self.scheduler.on_step_done(step, sampled, self.eos_token_ids)
        outputs = self._outputs(step, sampled) + [self._fail_draw(seq) for seq in failed]
        self.tally.on_step(False, len(step.seqs), (time.perf_counter() - began) * 1e3)
        return outputs

    def _fail_draw(self, seq: Sequence) -> RequestOutput:
        """The output of a sequence whose queued row could not be drawn."""
        failure = failure_of(seq.sampling, FloatingPointError(NON_FINITE))
        log.error("sampling failed for request %s: %s", seq.request_id, failure)
        return self._fail(seq, failure)

    # ---- isolation: one sequence's failure is its own (failure.py) -----------------------------

    def _without_failed(self, step: ScheduledStep, failed: list[Sequence]) -> ScheduledStep:
        """`step` minus the failed sequences, which are finished and release their blocks."""
        for seq in failed:
            self.scheduler.abort(seq.request_id)
            self._seqs.pop(seq.request_id, None)
        failed_ids = {seq.request_id for seq in failed}
        keep = [i for i, seq in enumerate(step.seqs) if seq.request_id not in failed_ids]
        return replace(
            step,
            seqs=tuple(step.seqs[i] for i in keep),
            start_positions=tuple(step.start_positions[i] for i in keep),
        )

    def _fail(self, seq: Sequence, failure: SequenceFailure) -> RequestOutput:
        self.tally.num_failed += 1
        self.notes.finished(seq.request_id)
        return RequestOutput(seq.request_id, (), True, "error", failure=failure)

    def _outputs(self, step: ScheduledStep, sampled: Seq[int]) -> list[RequestOutput]:
        outputs = []
        now = self.clock()
        for seq, token in zip(step.seqs, sampled, strict=True):
            finished = seq.status is SeqStatus.FINISHED
            facts = None
            if seq.first_token_s is None:
                seq.first_token_s = now
                facts = seq.prefill_facts()
                self.tally.on_prefilled(facts, looked_up=not seq.bypass_cache)
                self.notes.prefilled(seq.request_id)
            self.tally.generated_tokens += 1
            if finished:
                self._seqs.pop(seq.request_id, None)
                self.notes.finished(seq.request_id)
                self.tally.num_finished += 1
                self._keep_session(seq)
            outputs.append(
                RequestOutput(seq.request_id, (token,), finished, seq.finish_reason, facts)
            )
        return outputs

    def _keep_session(self, seq: Sequence) -> None:
        """Keep a finished turn's chain warm: the leading run of its blocks still registered
        (prompt and answer, so the next turn, which quotes both, matches all of it)."""
        if seq.session_id and seq.finish_reason != "abort" and not seq.bypass_cache:
            chain = self.pool.match_prefix(seq.full_block_hashes(self.block_size))
            self.sessions.keep(seq.session_id, chain)

    # ---- cache state and events -----------------------------------------------------------------

    def clear_cache(self, cache_epoch: int | None = None) -> int:
        """Forget every cached block not in use and move to a new cache epoch (`cache_epoch`,
        else the next one): blocks still held by running requests keep their old-epoch hashes,
        which no request hashed from now on can match, and requests not admitted yet are
        re-hashed under the new epoch (letting go of what they pinned). Starts a new
        generation."""
        self.cache_epoch = max(self.cache_epoch + 1, cache_epoch or 0)
        for seq in [*self.scheduler.waiting, *self.pulls.sequences()]:
            self._reroot(seq)
        dropped = self.pool.evict_all_free()
        self.pool.drain_evicted()
        self.pool.drain_events()
        if self.host_pool is not None:
            dropped += self.host_pool.num_cached
            self.host_pool.clear()
            self.host_pool.drain_events()
        self.events.new_generation()
        return dropped

    def _reroot(self, seq: Sequence) -> None:
        """Hash a request that has not started under the current epoch: what it pinned (old
        epoch) is let go, and a pull in flight registers blocks its new chain cannot match."""
        if seq.pinned_blocks:
            self.scheduler.unpin(seq)
            seq.num_pulled_tokens = seq.num_host_tokens = 0
        seq.root_hash = self.root_hash(seq.cache_salt, seq.adapter)
        seq.block_hashes = []

    def drain_event_batch(self) -> EventBatch | None:
        return self.events.drain()

    def drain_request_notes(self) -> NoteBatch | None:
        """What happened to requests since the last call (`NoteLog`)."""
        return self.notes.drain()

    def full_state_batch(self) -> EventBatch:
        """Everything the pools hold, under a new generation (after Redis lost our events)."""
        return self.events.full_state()

    @property
    def generation(self) -> int:
        return self.events.generation

    def info(self) -> WorkerInfo:
        pipeline = self.decode_pipeline
        counters = self.tally.snapshot(
            self.scheduler.num_preemptions,
            self.host_pool.num_cached if self.host_pool else 0,
            self.sessions.stats(),
            self.pool.num_evicted,
            self.host_pool.num_evicted if self.host_pool else 0,
            self.runner.decode_graph_counts(),
            self.runner.prefill_graph_counts(),
            self.runner.block_io.num_layer_loads,
            self.runner.block_io.num_copy_engine_loads,
            pipeline.num_queued_steps if pipeline is not None else 0,
            pipeline.num_dropped_rows if pipeline is not None else 0,
            self.runner.page_reads,
            self.scheduler.num_relocated_blocks,
        )
        return WorkerInfo(
            worker_id=self.worker_id,
            pid=os.getpid(),
            node=self.node,
            device=self.device,
            model=self.model_fingerprint,
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.pool.num_cached,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.pulls),
            num_queued_prefill_tokens=self.backlog.num_tokens,
            adapters=tuple(sorted(self.runner.adapters)),
            generation=self.generation,
            counters=counters,
            cache=self._cache_stats(counters),
        )

    def _cache_stats(self, c: WorkerCounters) -> CacheStats:
        return CacheStats(
            enabled=self.prefix_cache,
            block_size=self.block_size,
            kv_dtype=self.kv_dtype,
            cache_epoch=self.cache_epoch,
            num_lookup_hits=c.num_lookup_hits,
            num_lookup_misses=c.num_lookup_misses,
            local_hit_tokens=c.cached_tokens,
            host_hit_tokens=self.tally.prompt_host_tokens,
            pulled_hit_tokens=c.pulled_tokens,
            saved_prefill_tokens=c.cached_tokens + self.tally.prompt_host_tokens + c.pulled_tokens,
            num_device_evictions=c.num_evicted_blocks,
            num_host_evictions=c.num_host_evicted_blocks,
            num_preemptions=c.num_preemptions,
            num_device_entries=self.pool.num_cached,
            num_host_entries=c.num_host_blocks,
            num_bytes=(self.pool.num_cached + c.num_host_blocks) * self.block_num_bytes,
        )

    def check_invariants(self) -> None:
        held: list[BlockId] = [*self.pull_source.held_blocks(), *self.pulls.held_blocks()]
        if self.decode_pipeline is not None:
            self.decode_pipeline.check_invariants()
            held += self.decode_pipeline.held_blocks()
        self.scheduler.check_invariants(held)
        self.pull_source.check_invariants()
        self.sessions.sync()
        self.sessions.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
