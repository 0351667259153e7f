"""The worker's logic, without Ray: requests in, tokens and KV events out.

Its inputs and outputs (`WorkerRequest`, `RequestOutput`, `WorkerInfo`) live in `messages` and
are re-exported here.

The actor shell (actor.py) owns the threads and Ray; this class owns the pool, the scheduler and
the model runner, and is driven by `step()`. Time comes from the injected clock.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from kvmesh.proto.block_hash import BlockHash, namespace_hash
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockStored, EventBatch, KVEvent
from kvmesh.workers.engine.failure import SequenceFailure, forward_isolated
from kvmesh.workers.engine.messages import RequestOutput, WorkerCounters, WorkerInfo, WorkerRequest
from kvmesh.workers.engine.sampler import sample_isolated
from kvmesh.workers.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig, StepKind
from kvmesh.workers.engine.sequence import SeqStatus, Sequence
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.transfer.block_copy import copy_blocks
from kvmesh.workers.transfer.links import BlockExport

__all__ = ["RequestOutput", "Worker", "WorkerCounters", "WorkerInfo", "WorkerRequest"]

log = logging.getLogger(__name__)


class Worker:
    """One GPU's (or CPU's) engine: block pool + scheduler + model runner.

    Invariants: the pool's cached hashes are exactly what the published events say it holds
    (stored minus removed since the last AllCleared of this generation); `check_invariants`
    verifies the pool and the scheduler.
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
        device: str = "cpu",
        logits_sink: Callable[[str, torch.Tensor], None] | None = None,
        host_pool: HostPool | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.runner = runner
        self.model_fingerprint = model_fingerprint
        # Redis key namespace: one per model, shared by all its tenants (salts live in the hashes).
        self.namespace = f"{namespace_hash(model_fingerprint):016x}"
        self.device = device
        self.clock = clock
        self.pool = BlockPool(runner.num_blocks, clock)
        self.host_pool = host_pool
        self.scheduler = Scheduler(scheduler_config, self.pool)
        self.block_size = scheduler_config.block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.generation = time.time_ns()
        self._seq = 0
        self._seqs: dict[str, Sequence] = {}
        self.counters = WorkerCounters()
        # Debug / test hook: receives (request_id, logits row) for every sampled token.
        self._logits_sink = logits_sink

    def root_hash(self, cache_salt: str = "") -> BlockHash:
        return namespace_hash(self.model_fingerprint, "", cache_salt)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, req: WorkerRequest) -> None:
        if req.request_id in self._seqs:
            raise ValueError("a request with this id is already running on this worker")
        problem = req.sampling.problem()  # checked at the door too; a worker trusts no caller
        if problem is not None:
            raise ValueError(problem)
        vocab = self.runner.config.vocab_size
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        bad = max(req.prompt_ids)
        if bad >= vocab or min(req.prompt_ids) < 0:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        context = self.runner.config.max_position_embeddings
        total = len(req.prompt_ids) + req.sampling.max_tokens
        if total > context:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)}) + max_tokens ({req.sampling.max_tokens}) = {total}"
                f" exceeds the model's context of {context} tokens"
            )
        seq = Sequence(
            req.request_id,
            list(req.prompt_ids),
            req.sampling,
            self.root_hash(req.cache_salt),
            self.clock(),
        )
        self.scheduler.add(seq)
        self._seqs[req.request_id] = seq
        self.counters.num_requests += 1

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns what each touched request produced."""
        self._promote_from_host()
        step = self.scheduler.schedule()
        self._demote_evicted()  # before the forward pass overwrites the reallocated blocks
        if step is None:
            return []
        started = time.perf_counter()
        chunks = [
            SeqChunk(seq.all_ids[start:], start, seq.block_table)
            for seq, start in zip(step.seqs, step.start_positions, strict=True)
        ]
        results = self._forward_and_sample(step, chunks)
        if step.kind is StepKind.PREFILL:
            self.counters.prefill_ms_total += (time.perf_counter() - started) * 1e3
            self.counters.prefill_tokens_total += sum(len(c.token_ids) for c in chunks)
        failed = [
            (seq, r) for seq, r in zip(step.seqs, results, strict=True) if not isinstance(r, int)
        ]
        sampled = [r for r in results if isinstance(r, int)]
        if failed:
            step = self._without_failed(step, [seq for seq, _ in failed])
        self.scheduler.on_step_done(step, sampled, self.eos_token_ids)
        return self._outputs(step, sampled) + [self._fail(seq, f) for seq, f in failed]

    # ---- isolation: one sequence's failure is its own ------------------------------------------

    def _forward_and_sample(
        self, step: ScheduledStep, chunks: list[SeqChunk]
    ) -> list[int | SequenceFailure]:
        """A token per sequence of `step`, or that sequence's failure (forward pass or sampling);
        the others get exactly what they would get alone."""
        ids = [seq.request_id for seq in step.seqs]
        rows = forward_isolated(self.runner.forward, chunks, ids)
        out: list[int | SequenceFailure] = [
            r if isinstance(r, SequenceFailure) else -1 for r in rows
        ]
        live = [i for i, r in enumerate(rows) if isinstance(r, torch.Tensor)]
        if not live:
            return out
        logits = torch.stack([r for r in rows if isinstance(r, torch.Tensor)])
        if self._logits_sink is not None:
            for i, row in zip(live, logits, strict=True):
                self._logits_sink(step.seqs[i].request_id, row.detach().cpu())
        seqs = [step.seqs[i] for i in live]
        tokens = sample_isolated(logits, [s.sampling for s in seqs], [s.num_tokens for s in seqs])
        for i, token in zip(live, tokens, strict=True):
            out[i] = token
            if isinstance(token, SequenceFailure) and token.internal:
                log.error("sampling failed for request %s: %s", step.seqs[i].request_id, token)
        return out

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
        self.counters.num_failed += 1
        return RequestOutput(seq.request_id, (), True, "error", failure=failure)

    def _outputs(self, step: ScheduledStep, sampled: Seq[int]) -> list[RequestOutput]:
        outputs = []
        now = self.clock()
        for seq, token in zip(step.seqs, sampled, strict=True):
            finished = seq.status is SeqStatus.FINISHED
            first = seq.first_token_s is None
            if first:
                seq.first_token_s = now
                self.counters.prompt_tokens += len(seq.prompt_ids)
                self.counters.cached_tokens += seq.num_cached_tokens
                self.counters.computed_tokens += seq.num_computed_prompt_tokens
            self.counters.generated_tokens += 1
            if finished:
                self._seqs.pop(seq.request_id, None)
                self.counters.num_finished += 1
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    (token,),
                    finished,
                    seq.finish_reason,
                    seq.num_cached_tokens if first else -1,
                    seq.num_computed_prompt_tokens if first else -1,
                )
            )
        return outputs

    # ---- tiers and transfer ----------------------------------------------------------------------

    def _promote_from_host(self) -> None:
        """Copy host-tier continuations of waiting prompts back to the device, so admission finds
        them cached. Installed blocks stay free (matchable) until a sequence takes them."""
        if self.host_pool is None or not self.host_pool.num_cached:
            return
        bs = self.block_size
        for seq in list(self.scheduler.waiting)[: self.scheduler.config.max_num_seqs]:
            hashes = seq.full_block_hashes(bs)[: (seq.num_tokens - 1) // bs]
            k = len(self.pool.match_prefix(hashes))
            n = self.host_pool.match(hashes[k:])
            if n:
                parent = hashes[k - 1] if k else seq.root_hash
                run = hashes[k : k + n]
                device = self.runner.kv_cache.device
                installed = self._install(run, self.host_pool.get(run, device), parent)
                self.counters.host_hit_tokens += installed * bs

    def _demote_evicted(self) -> None:
        evicted = self.pool.drain_evicted()
        if self.host_pool is None or not evicted:
            return
        ids = [b for b, _h in evicted]
        self.host_pool.put([h for _b, h in evicted], self.runner.export_blocks(ids))

    def _install(
        self,
        hashes: Seq[BlockHash],
        blocks: torch.Tensor | Callable[[list[BlockId]], None],
        parent: BlockHash,
    ) -> int:
        """Write blocks under their hashes as free, registered (matchable) blocks; returns how
        many of the leading run were installed (fewer when the pool is short). `blocks` is the
        data (export layout) or a writer that fills the given fresh blocks in place."""
        n = min(len(hashes), self.pool.num_free)
        if n == 0:
            return 0
        ids = self.pool.allocate(n)
        assert ids is not None
        self._demote_evicted()
        try:
            if callable(blocks):
                blocks(ids)
            else:
                self.runner.import_blocks(ids, blocks[:n])
        except Exception:
            self.pool.free(ids)  # half-imported blocks are released unregistered
            raise
        for block, h in zip(ids, hashes[:n], strict=True):
            self.pool.register(block, h, parent)
            parent = h
        self.pool.free(ids)
        return n

    def export_blocks(self, hashes: Seq[BlockHash], to_cpu: bool = True) -> BlockExport:
        """The leading run of `hashes` this worker holds (device tier, then host tier)."""
        ids = self.pool.match_prefix(hashes)
        parts = [self.runner.export_blocks(ids)] if ids else []
        found = list(hashes[: len(ids)])
        if self.host_pool is not None:
            n = self.host_pool.match(hashes[len(ids) :])
            if n:
                run = hashes[len(ids) : len(ids) + n]
                parts.append(self.host_pool.get(run, self.runner.kv_cache.device))
                found += run
        if not parts:
            parts = [self.runner.export_blocks([])]
        blocks = torch.cat(parts) if len(parts) > 1 else parts[0]
        return BlockExport(self.worker_id, tuple(found), blocks.cpu() if to_cpu else blocks)

    def import_blocks(self, export: BlockExport, parent: BlockHash) -> int:
        """Install a peer's run (chain order, `parent` before its first block); returns how many
        blocks are now held locally from it. Blocks already held are skipped, not copied."""
        hashes = list(export.hashes)
        if export.blocks.shape[0] != len(hashes):
            raise ValueError(f"{export.blocks.shape[0]} blocks for {len(hashes)} hashes")
        held = len(self.pool.match_prefix(hashes))
        if held == len(hashes):
            return held
        start_parent = hashes[held - 1] if held else parent
        installed = self._install(hashes[held:], export.blocks[held:], start_parent)
        self.counters.pulled_blocks += installed
        return held + installed

    def pin_run(self, hashes: Seq[BlockHash]) -> list[BlockId]:
        """Take refs on the leading device run of `hashes` so a peer can copy it in place
        (same-GPU pulls); `unpin` releases them."""
        ids = self.pool.match_prefix(hashes)
        self.pool.acquire(ids)
        return ids

    def unpin(self, ids: Seq[BlockId]) -> None:
        self.pool.free(ids)

    def import_from_peer_cache(
        self,
        peer_cache: torch.Tensor,
        ids: Seq[int],
        hashes: Seq[BlockHash],
        parent: BlockHash,
    ) -> int:
        """Copy pinned blocks straight out of a peer's cache mapped into this process (CUDA IPC):
        one strided copy per contiguous run, no staging buffer, no host round trip."""
        if len(ids) != len(hashes):
            raise ValueError(f"{len(ids)} peer blocks for {len(hashes)} hashes")
        ours = self.runner.kv_cache
        same_layout = (
            peer_cache.shape[:2] == ours.shape[:2] and peer_cache.shape[3:] == ours.shape[3:]
        )
        if not same_layout or peer_cache.dtype != ours.dtype:
            raise ValueError(
                f"peer cache {tuple(peer_cache.shape)} {peer_cache.dtype} does not match ours "
                f"{tuple(ours.shape)} {ours.dtype}"
            )
        held = len(self.pool.match_prefix(hashes))
        if held == len(hashes):
            return held
        src = [int(b) for b in ids[held:]]

        def write(dst: list[BlockId]) -> None:
            copy_blocks(self.runner.kv_cache, [int(b) for b in dst], peer_cache, src[: len(dst)])

        start_parent = hashes[held - 1] if held else parent
        installed = self._install(hashes[held:], write, start_parent)
        if peer_cache.is_cuda:
            torch.cuda.synchronize(peer_cache.device)  # the peer unpins once we return
        self.counters.pulled_blocks += installed
        return held + installed

    def clear_cache(self) -> int:
        """Forget every cached block not in use; starts a new generation."""
        dropped = self.pool.evict_all_free()
        self.pool.drain_evicted()
        self.pool.drain_events()
        if self.host_pool is not None:
            dropped += self.host_pool.num_cached
            self.host_pool.clear()
            self.host_pool.drain_events()
        self.generation = time.time_ns()
        self._seq = 0
        return dropped

    def drain_event_batch(self) -> EventBatch | None:
        events = self.pool.drain_events()
        if self.host_pool is not None:
            events += self.host_pool.drain_events()
        if not events:
            return None
        return self._next_batch(events)

    def full_state_batch(self) -> EventBatch:
        """Everything the pool holds, under a new generation (after Redis lost our events)."""
        self.pool.drain_events()
        events: list[KVEvent] = [AllCleared()]
        if self.host_pool is not None:
            self.host_pool.drain_events()
            events.append(BlockStored(tuple(self.host_pool.cached_hashes()), TIER_HOST))
        events.append(BlockStored(tuple(self.pool.cached_hashes())))
        self.generation = time.time_ns()
        self._seq = 0
        return self._next_batch(events)

    def _next_batch(self, events: list[KVEvent]) -> EventBatch:
        self._seq += 1
        return EventBatch(
            self.worker_id, self.generation, self._seq, tuple(events), time.time_ns() // 1_000_000
        )

    def info(self) -> WorkerInfo:
        c = self.counters
        return WorkerInfo(
            worker_id=self.worker_id,
            pid=os.getpid(),
            node=socket.gethostname(),
            device=self.device,
            model=self.model_fingerprint,
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.pool.num_cached,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            generation=self.generation,
            counters={
                "num_requests": c.num_requests,
                "num_finished": c.num_finished,
                "num_failed": c.num_failed,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "computed_tokens": c.computed_tokens,
                "generated_tokens": c.generated_tokens,
                "prefill_ms_per_token": c.prefill_ms_total / max(1, c.prefill_tokens_total),
                "num_preemptions": self.scheduler.num_preemptions,
                "host_hit_tokens": c.host_hit_tokens,
                "pulled_blocks": c.pulled_blocks,
                "num_host_blocks": self.host_pool.num_cached if self.host_pool else 0,
            },
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
