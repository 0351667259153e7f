"""The prefill backlog: the prompt tokens a worker still has to compute, as the router reads it."""

from __future__ import annotations

from kvmesh.proto.block_hash import num_reusable_blocks, num_reusable_tokens
from kvmesh.workers.contract.requests import PullSpec
from kvmesh.workers.engine.pull_admission import PullAdmission
from kvmesh.workers.engine.scheduler import Scheduler
from kvmesh.workers.engine.sequence import Sequence
from kvmesh.workers.kv.block_pool import BlockPool


class PrefillBacklog:
    """Prompt tokens still to prefill on one worker (`WorkerInfo.num_queued_prefill_tokens`):
    each waiting prompt less the prefix its pool holds now, plus what running prompts have left.
    `update` runs on the engine thread after anything that changes the queue; `num_tokens` is
    read from other threads, which only read the number."""

    def __init__(
        self, pool: BlockPool, scheduler: Scheduler, pulls: PullAdmission, block_size: int
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.pulls = pulls
        self.block_size = block_size
        self.num_tokens = 0
        # request id -> (the sequence, the pool's hash changes, its length, its tokens left), as
        # last counted: a waiting prompt is matched again only when the pool's hashes or its
        # length have moved since (the recount ran after every arrival and step, ~40 us a
        # waiting 8K prompt).
        self._left: dict[str, tuple[Sequence, int, int, int]] = {}

    def update(self) -> None:
        self.num_tokens = self._queued_prefill_tokens()

    def _queued_prefill_tokens(self) -> int:
        stamp = self.pool.num_hash_changes
        queued = 0
        left: dict[str, tuple[Sequence, int, int, int]] = {}
        for s in [*self.scheduler.waiting, *self.pulls.sequences()]:
            n = self._tokens_left(s, stamp)
            left[s.request_id] = (s, stamp, s.num_tokens, n)
            queued += n
        self._left = left
        return queued + sum(
            max(0, len(s.prompt_ids) - s.num_computed_tokens) for s in self.scheduler.running
        )

    def _tokens_left(self, s: Sequence, stamp: int) -> int:
        """`s`'s prompt tokens less the prefix the pool holds: as last counted if neither the
        pool's hashes nor `s` moved since, else matched again."""
        known = self._left.get(s.request_id)
        if known is not None and known[0] is s and known[1:3] == (stamp, s.num_tokens):
            return known[3]
        bs = self.block_size
        return s.num_tokens - len(s.reusable_prefix_in(self.pool, bs)) * bs

    def uncached_len(self, seq: Sequence, pull: PullSpec | None) -> int:
        """Prompt tokens `seq` will compute here: less what the pool holds now, or what the
        pull brings."""
        if seq.bypass_cache:
            return seq.num_tokens
        bs = self.block_size
        held = (seq.num_tokens - self._tokens_left(seq, self.pool.num_hash_changes)) // bs
        if pull is not None:
            held = max(held, min(pull.end_block, num_reusable_blocks(seq.num_tokens, bs)))
        return seq.num_tokens - num_reusable_tokens(seq.num_tokens, held, bs)
