"""Decode steps queued one ahead of the host: step n + 1 is launched with step n's tokens still
on the device (`ModelRunner.forward_tokens`: the argmax, or the sampler's `draw` for a batch
with sampled sequences), and step n's tokens are read, and its outputs made, while n + 1 runs.

    engine:  launch n+1 | read n, outputs of n | calls, events | launch n+2 | read n+1, ...
    GPU:     ...  n     |                 n+1                               |    n+2   ...

Step n's outputs leave when its tokens are read, as they would without the pipeline; what goes is
the GPU's wait for the host's turn between steps (reading the tokens, outputs, the engine's
calls and events, the next batch's inputs).

Any decode step is queued (a sampled row draws at a uniform fixed by its seed and position,
known ahead), and another is queued behind it only while nothing waits for admission (a prefill
needs the scheduler to see every token). Which sequences step n + 1 carries is decided before
step n's tokens are known:

  * a sequence whose step-n token reaches its max_tokens is left out (known in advance);
  * one that step n ends with a stop token, or that is aborted meanwhile, rides along: its row
    is computed and dropped when n + 1 lands;
  * so does one whose step-n row could not be drawn (NaN or +inf logits): the engine fails that
    request alone when step n lands, as it would have without the queue.

A queued step holds a pool reference of its own on each block it writes until it lands, so a
sequence that ends meanwhile lets those blocks go only then: no other request (a pull's
transport writing on its own stream) is given a block the GPU is still writing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from kvmesh.workers.engine.sampler import draw
from kvmesh.workers.engine.scheduler import ScheduledStep, StepKind
from kvmesh.workers.engine.sequence import SeqStatus
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.model.step_tokens import StepTokens

__all__ = ["DecodePipeline", "QueuedDecode"]


@dataclass(frozen=True, slots=True)
class QueuedDecode:
    """A decode step on the device whose tokens the host has not read."""

    step: ScheduledStep
    tokens: StepTokens
    held: tuple[BlockId, ...]
    """The block each row writes its new token's K/V into, one pool reference each."""


class DecodePipeline:
    """Invariants: at most one step is queued and at most one is landing (taken, its tokens
    being read); each holds exactly one pool reference on each block of its `held`, released
    when it lands."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, block_size: int) -> None:
        self.runner = runner
        self.pool = pool
        self.block_size = block_size
        self.queued: QueuedDecode | None = None
        self.landing: QueuedDecode | None = None
        self.num_queued_steps = 0
        """Steps launched behind another, before the host had read its tokens."""
        self.num_dropped_rows = 0
        """Rows computed for sequences that had ended by the time their step landed."""

    @staticmethod
    def takes(step: ScheduledStep) -> bool:
        """Whether a scheduled step may be queued: a decode step whose sequences' sampling
        parameters are valid (one that skipped validation fails alone in the engine's own
        path)."""
        return step.kind is StepKind.DECODE and all(
            seq.sampling.problem() is None for seq in step.seqs
        )

    def held_blocks(self) -> list[BlockId]:
        """The blocks the queued and the landing step hold a reference on."""
        return [b for step in (self.queued, self.landing) if step is not None for b in step.held]

    def take(self) -> QueuedDecode:
        """The queued step, to `land` once its tokens are read; another may be queued behind it
        meanwhile."""
        queued = self.queued
        assert queued is not None and self.landing is None, "one step lands at a time"
        self.queued, self.landing = None, queued
        return queued

    def launch(self, step: ScheduledStep, behind: QueuedDecode | None = None) -> None:
        """Queue `step` on the device. `behind`: the landing step (`next_step` picked this
        step's sequences from it), whose tokens feed it; without it, the sequences' own last
        tokens. Raises what the runner raises, queueing nothing."""
        assert self.queued is None, "one step is queued at a time"
        fed: StepTokens | None = None
        if behind is not None:
            row_of = {id(seq): row for row, seq in enumerate(behind.step.seqs)}
            fed = behind.tokens.rows([row_of[id(seq)] for seq in step.seqs])
        chunks = [
            SeqChunk(
                [0] if fed is not None else seq.ids_from(start),  # a fed id is read on the GPU
                start,
                seq.block_table,
                adapter=seq.adapter,
            )
            for seq, start in zip(step.seqs, step.start_positions, strict=True)
        ]
        configs = [seq.sampling for seq in step.seqs]
        pick = None
        if any(c.temperature != 0.0 for c in configs):  # drawn where the sampler would draw
            positions = [start + 1 for start in step.start_positions]
            pick = functools.partial(draw, configs=configs, positions=positions)
        tokens = self.runner.forward_tokens(chunks, previous=fed, pick=pick)
        bs = self.block_size
        held = tuple(
            seq.block_table[start // bs]
            for seq, start in zip(step.seqs, step.start_positions, strict=True)
        )
        self.pool.acquire(held)
        self.queued = QueuedDecode(step, tokens, held)
        self.num_queued_steps += behind is not None

    def next_step(self) -> ScheduledStep | None:
        """The landing step's sequences that go on (see the module doc), each given a block for
        its next token where it needs one; None when none goes on or a block is short (the
        scheduler takes over once that step has landed; blocks given so far stay in their
        sequences' tables, where it finds them)."""
        queued = self.landing
        assert queued is not None, "nothing is landing"
        seqs = []
        for seq in queued.step.seqs:
            if seq.status is not SeqStatus.RUNNING:
                continue  # ended or aborted since that step was queued
            if len(seq.output_ids) + 1 >= seq.sampling.max_tokens:
                continue  # the landing step gives it its last token
            position = seq.num_tokens  # of the landing step's token, once appended
            if position // self.block_size >= len(seq.block_table):
                block = self.pool.allocate(1)
                if block is None:
                    return None
                seq.block_table.extend(block)
            seqs.append(seq)
        if not seqs:
            return None
        positions = tuple(seq.num_tokens for seq in seqs)
        return ScheduledStep(StepKind.DECODE, tuple(seqs), positions)

    def drop(self) -> None:
        """Let the landing step go without its tokens (reading them failed): its blocks'
        references go back; its sequences, which the engine then fails, keep theirs."""
        self._release_landing()

    def land(self, tokens: Seq[int]) -> tuple[ScheduledStep, list[int]]:
        """The landing step's tokens have been read: release its blocks, and return its
        sequences still running with their tokens (the others' rows are dropped)."""
        step = self._release_landing().step
        live = [i for i, seq in enumerate(step.seqs) if seq.status is SeqStatus.RUNNING]
        self.num_dropped_rows += len(step.seqs) - len(live)
        landed = replace(
            step,
            seqs=tuple(step.seqs[i] for i in live),
            start_positions=tuple(step.start_positions[i] for i in live),
        )
        return landed, [tokens[i] for i in live]

    def check_invariants(self) -> None:
        for step in (self.queued, self.landing):
            if step is not None:
                assert len(step.held) == len(step.step.seqs) == len(step.tokens)
                assert all(self.pool.ref_count(b) >= 1 for b in step.held), step.held

    def _release_landing(self) -> QueuedDecode:
        queued = self.landing
        assert queued is not None, "nothing is landing"
        self.landing = None
        self.pool.free(list(queued.held))
        return queued
