"""Continuous batching: prefill first, then one batched decode step over every running sequence.

Admission is bounded by free blocks: a waiting sequence is admitted only when the pool can hold
its tokens (after reusing the longest cached prefix). When a running sequence needs a block for
its next token and none is free, the most recently admitted other sequence is preempted: its
blocks are freed and it goes back to the head of the queue, to be recomputed (its prefix is often
still cached). A request that could not fit an empty pool is refused when it is added, so the
queue never waits on something impossible.

A waiting sequence may hold refs on a prefix fetched for it (a pull, a host-tier promotion):
admission takes its own refs on the matched blocks, then drops those. When a running sequence
cannot grow and there is nothing left to preempt, waiting sequences give their pins up first
(the blocks stay cached and matchable, just evictable), so pins can never deadlock the pool.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvmesh.workers.engine.sequence import SeqStatus, Sequence
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.block_runs import all_runs, relocated_tail


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 8192
    """Prefill token budget per step (a single longer prompt still runs alone)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    kind: StepKind
    seqs: tuple[Sequence, ...]
    start_positions: tuple[int, ...]  # per sequence: tokens whose KV is already written


class Scheduler:
    """Invariants: every running sequence holds refs on exactly its block_table; a waiting
    sequence holds refs on exactly its pinned_blocks and has no block_table; finished sequences
    hold none; len(running) <= max_num_seqs."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        *,
        can_relocate: Callable[[Seq[BlockId]], bool] = lambda blocks: True,
        protected_may_move: Callable[[BlockId], bool] = lambda block: False,
    ) -> None:
        """`can_relocate(blocks)`: these cached blocks' KV is all written, so a step may copy
        them (the worker's pending layered writes say; see `Sequence.relocated`);
        `protected_may_move(block)`: a copy may take this protected block's hash and protection
        over (`BlockPool.take_over`; the warm sessions say)."""
        self.config = config
        self.pool = pool
        self.can_relocate = can_relocate
        self.protected_may_move = protected_may_move
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_relocated_blocks = 0
        """Cached blocks copied into a prompt's run at admission (`_relocation`)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def max_tokens_fitting(self) -> int:
        return self.pool.num_blocks * self.config.block_size

    def check_fits(self, seq: Sequence) -> None:
        """Refuse what could not run even in an empty pool, so the queue never waits on it."""
        total = len(seq.prompt_ids) + seq.sampling.max_tokens
        if total > self.max_tokens_fitting():
            raise ValueError(
                f"prompt ({len(seq.prompt_ids)}) + max_tokens ({seq.sampling.max_tokens}) = {total}"
                f" tokens exceed this worker's KV pool of {self.max_tokens_fitting()} tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.unpin(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def schedule(self) -> ScheduledStep | None:
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledStep | None:
        bs = self.config.block_size
        admitted: list[Sequence] = []
        starts: list[int] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            matched = [] if seq.bypass_cache else seq.reusable_prefix_in(self.pool, bs)
            num_new_tokens = seq.num_tokens - len(matched) * bs
            if admitted and num_new_tokens > budget:
                break
            num_free_matched = self.pool.num_free_of(matched)
            num_new_blocks = -(-seq.num_tokens // bs) - len(matched)
            if not self.pool.can_allocate(num_new_blocks + num_free_matched):
                break  # wait for running sequences to free blocks
            self.pool.acquire(matched)
            self.unpin(seq)
            num_relocated = self._relocation(matched, num_new_blocks, num_new_tokens)
            kept = len(matched) - num_relocated
            # (the tail to copy stays held until its fresh blocks are taken, so that they are
            # never among them: the copy reads one and writes the other in one kernel)
            fresh = self.pool.allocate(num_new_blocks + num_relocated)
            assert fresh is not None
            self.pool.free(matched[kept:])
            self.waiting.popleft()
            seq.block_table = matched[:kept] + fresh
            seq.relocated = matched[kept:]
            self.num_relocated_blocks += num_relocated
            seq.num_computed_tokens = len(matched) * bs
            seq.num_registered_blocks = kept
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = len(matched) * bs
                seq.num_computed_prompt_tokens = len(seq.prompt_ids) - seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
            starts.append(seq.num_computed_tokens)
            budget -= num_new_tokens
        if not admitted:
            return None
        self.running.extend(admitted)
        return ScheduledStep(StepKind.PREFILL, tuple(admitted), tuple(starts))

    def _relocation(self, matched: list[BlockId], num_new_blocks: int, num_new_tokens: int) -> int:
        """How many of the matched (and acquired) blocks' tail to copy into fresh blocks, so
        the table goes in runs (`block_runs.relocated_tail`); 0 where `can_relocate` says the
        tail is being written (a pull, a promotion), the pool hands out no runs, or the blocks
        it would hand out now leave the table broken all the same (`block_runs.all_runs`)."""
        run_blocks = self.pool.run_blocks
        tail = relocated_tail(matched, run_blocks, num_new_tokens)
        if not tail or not self.can_relocate(matched[-tail:]):
            return 0
        fresh = self.pool.next_allocation(num_new_blocks + tail)
        if fresh is None or not all_runs(matched[:-tail] + fresh, run_blocks):
            return 0
        return tail

    def _schedule_decode(self) -> ScheduledStep | None:
        bs = self.config.block_size
        scheduled: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            position = seq.num_tokens - 1  # the last sampled token gets its KV now
            if position // bs >= len(seq.block_table):
                block = self.pool.allocate(1)
                if block is None and self._unpin_waiting():
                    continue  # pins given up: the freed blocks are allocatable now
                if block is None:
                    victim = self.running[-1]
                    if victim is seq and len(self.running) == 1:
                        raise AssertionError(
                            "a lone sequence cannot outgrow a pool it was checked against"
                        )
                    self._preempt(victim)
                    continue  # retry the same index (the victim may have been this one)
                seq.block_table.extend(block)
            scheduled.append(seq)
            i += 1
        scheduled = [s for s in scheduled if s.status is SeqStatus.RUNNING]
        if not scheduled:
            return None
        return ScheduledStep(
            StepKind.DECODE, tuple(scheduled), tuple(s.num_tokens - 1 for s in scheduled)
        )

    def unpin(self, seq: Sequence) -> None:
        self.pool.free(seq.pinned_blocks)
        seq.pinned_blocks = []

    def _unpin_waiting(self) -> bool:
        """Give up every waiting sequence's pins; False if none held any."""
        pinned = [s for s in self.waiting if s.pinned_blocks]
        for seq in pinned:
            self.unpin(seq)
        return bool(pinned)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_step_done(self, step: ScheduledStep, sampled: Seq[int], eos_ids: Seq[int]) -> None:
        """Record the KV just written, register full blocks, append tokens, finish sequences."""
        bs = self.config.block_size
        for seq, token in zip(step.seqs, sampled, strict=True):
            seq.num_computed_tokens = seq.num_tokens
            num_full = seq.num_computed_tokens // bs
            # Hashes only when a block filled (most decode steps fill none, and the chain would
            # be copied for nothing); a sequence that bypasses the cache registers none.
            if num_full > seq.num_registered_blocks and not seq.bypass_cache:
                hashes = seq.full_block_hashes(bs)
                first = seq.num_registered_blocks
                if seq.relocated:  # copies written by now: they take the hashes over
                    end = first + len(seq.relocated)
                    self.pool.take_over(
                        seq.block_table[first:end],
                        hashes[first:end],
                        seq.parent_hash(first),
                        depth=first + 1,
                        protected_may_move=self.protected_may_move,
                    )
                    first, seq.relocated = end, []
                self.pool.register_run(
                    seq.block_table[first:num_full],
                    hashes[first:num_full],
                    seq.parent_hash(first),
                    depth=first + 1,
                )
            seq.num_registered_blocks = num_full
            seq.output_ids.append(token)
            cfg = seq.sampling
            if len(seq.output_ids) >= cfg.max_tokens:
                self.finish(seq, "length")
            elif token in cfg.stop_token_ids or (not cfg.ignore_eos and token in eos_ids):
                self.finish(seq, "stop")

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def check_invariants(self, held_elsewhere: Seq[int] = ()) -> None:
        """`held_elsewhere`: blocks referenced outside the scheduler (pull reservations, runs
        pinned for a peer's copy), one entry per reference."""
        assert len(self.running) <= self.config.max_num_seqs
        refs: dict[int, int] = {}
        for b in held_elsewhere:
            refs[b] = refs.get(b, 0) + 1
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        for seq in self.waiting:
            assert not seq.block_table, f"waiting {seq.request_id} holds blocks"
            for b in seq.pinned_blocks:
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == refs.get(b, 0), f"block {b}: refs do not match tables"  # type: ignore[arg-type]
        self.pool.check_invariants()
