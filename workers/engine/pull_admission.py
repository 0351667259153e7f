"""Requests admitted with a pull plan, from reservation to the scheduler's queue.

A request whose prefix lives on a peer is admitted in three steps, so the worker owns the pulled KV
from the first moment and nothing can evict it before use:

    reserve(seq, spec)   local prefix pinned, blocks for the pulled run allocated (or None: the
                         plan does not fit this prompt's chain, or the pool has no room; then the
                         request simply recomputes)
    write(id, fill)      the transport writes the reserved blocks (`PullTargets`: which block
                         holds which of the plan's hashes)
    finish(id, n, t)     n blocks registered, the prefix pinned for the request, which the caller
                         then queues for admission

A request that goes away in between is `release`d: its reservation goes back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvmesh.proto.block_hash import num_reusable_blocks
from kvmesh.workers.contract.requests import PullSpec
from kvmesh.workers.engine.host_tier import HostTier
from kvmesh.workers.engine.sequence import Sequence
from kvmesh.workers.kv import pull_reservation
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.pull_reservation import PullReservation


@dataclass(frozen=True, slots=True)
class PullTargets:
    """The reserved blocks a transport writes: `blocks[i]` is to hold the plan's hash
    `first + i`. The source fetched the plan's leading run before the reservation was known, so
    the two are lined up here: `first` > 0 when this worker already held the plan's first
    blocks, < 0 when it lacks blocks before the plan (nothing the source sent fits then)."""

    blocks: list[BlockId]
    first: int = 0

    def fillable(self, num_sent: int) -> int:
        """How many leading blocks a run of the plan's first `num_sent` blocks fills."""
        if self.first < 0:
            return 0
        return max(0, min(len(self.blocks), num_sent - self.first))


@dataclass(frozen=True, slots=True)
class PullTiming:
    """Where one pull's time went (ms), as the puller measured it."""

    total_ms: float
    """Start to the blocks registered."""
    source_ms: float = 0.0
    """Until the source answered (pinned its run, agreed to send, or exported it)."""
    write_ms: float = 0.0
    """The engine call that wrote the blocks (or enqueued their copy) and registered them."""

    @classmethod
    def between(
        cls, started_s: float, answered_s: float, write_began_s: float | None, done_s: float
    ) -> PullTiming:
        """From the clock's readings (s): the pull's start, the source's answer, the write
        call's start (None: nothing was written) and the blocks registered."""
        write_s = done_s - write_began_s if write_began_s is not None else 0.0
        return cls((done_s - started_s) * 1e3, (answered_s - started_s) * 1e3, write_s * 1e3)


BlockWriter = Callable[[PullTargets], int]
"""Fills the given reserved blocks (possibly none: the request went away) and returns how many
of the leading ones it wrote."""


@dataclass(frozen=True, slots=True)
class PendingPull:
    seq: Sequence
    reservation: PullReservation
    from_block: int
    end_block: int
    """The plan is chain blocks [from_block, end_block); the reservation may start later."""


class PullAdmission:
    """The requests between `reserve` and `finish`.

    Invariant: every pending pull's reservation (its pinned local prefix and its target blocks)
    holds pool references that nothing else releases; `held_blocks` lists them for the pool's
    accounting.
    """

    def __init__(self, pool: BlockPool, host_tier: HostTier, block_size: int) -> None:
        self.pool = pool
        self.host_tier = host_tier
        self.block_size = block_size
        self._pending: dict[str, PendingPull] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def sequences(self) -> Iterator[Sequence]:
        return (p.seq for p in self._pending.values())

    def held_blocks(self) -> list[BlockId]:
        held: list[BlockId] = []
        for pending in self._pending.values():
            held += [*pending.reservation.local, *pending.reservation.targets]
        return held

    def reserve(self, seq: Sequence, spec: PullSpec) -> PullReservation | None:
        """Pin seq's local prefix and allocate the blocks of the pulled run; None when the plan
        does not match seq's chain or the pool cannot hold it (the request recomputes)."""
        bs = self.block_size
        chain = seq.full_block_hashes(bs)
        end = min(spec.end_block, num_reusable_blocks(len(seq.prompt_ids), bs))
        if (
            end <= spec.from_block
            or tuple(chain[spec.from_block : end]) != spec.hashes[: end - spec.from_block]
        ):
            return None
        headroom = -(-seq.num_tokens // bs) - end  # the prompt's own blocks after the pulled run
        reservation = pull_reservation.reserve(self.pool, chain, end, seq.root_hash, headroom)
        self.host_tier.demote_evicted()  # before the transport overwrites reallocated blocks
        if reservation is None:
            return None
        self._pending[seq.request_id] = PendingPull(seq, reservation, spec.from_block, end)
        return reservation

    def write(self, request_id: str, fill: BlockWriter) -> int:
        """Run a transport's writer over the request's reserved blocks (none if it went away:
        a writer that must consume what a peer sends still runs)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return fill(PullTargets([]))
        reservation = pending.reservation
        first = len(reservation.local) - pending.from_block
        return fill(PullTargets(list(reservation.targets), first))

    def finish(
        self, request_id: str, num_written: int, timing: PullTiming, block_num_bytes: int
    ) -> tuple[Sequence, int] | None:
        """Register what the transport wrote and pin the prefix for the request; returns the
        request and its pulled blocks, or None if it was released meanwhile."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return None
        seq = pending.seq
        chain = seq.full_block_hashes(self.block_size)[: pending.end_block]
        pinned, num_pulled = pull_reservation.commit(
            self.pool, pending.reservation, num_written, chain
        )
        seq.pinned_blocks = pinned
        seq.num_pulled_tokens = num_pulled * self.block_size
        seq.pull_ms = timing.total_ms
        seq.pull_source_ms = timing.source_ms
        seq.pull_write_ms = timing.write_ms
        seq.pull_bytes = num_written * block_num_bytes
        return seq, num_pulled

    def release(self, request_id: str) -> bool:
        """Give a pending request's reservation back to the pool; False if it had none."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        pull_reservation.release(self.pool, pending.reservation)
        return True
