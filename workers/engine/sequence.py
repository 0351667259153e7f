"""One request's state inside a worker: its tokens, its blocks and how far its KV is written.

all_ids:      | prompt ....................... | output ......... |
KV written:   [0, num_computed_tokens)            the last sampled token has no KV yet
block_table:  one block per block_size tokens of all_ids that have (or are about to get) KV
              (append-only: extended, or replaced by a new list; never rewritten in place,
              which the decode graphs rely on to copy only what a table gained)
pinned:       while waiting, refs on a prefix pulled or promoted for it (dropped at admission)
block_hashes: chained hashes of every full block of all_ids, extended as tokens arrive

prompt_ids are `TokenIds` (one immutable uint32 buffer): hashed and sliced without a Python int
per prompt token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from kvmesh.proto.block_hash import BlockHash, block_hashes, num_reusable_blocks
from kvmesh.proto.token_ids import TokenIds
from kvmesh.workers.contract.replies import PrefillFacts
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.kv.block_pool import BlockId, BlockPool


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_ids: TokenIds
    sampling: SamplingConfig
    root_hash: BlockHash  # h_0 of the request's namespace (model + tenant)
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0
    relocated: list[BlockId] = field(default_factory=list)
    """Cached blocks whose KV its step copies into `block_table`'s entries from
    `num_registered_blocks` on, before the forward (`block_runs.relocated_tail`): set at
    admission, cleared once the copies took their hashes over."""
    pinned_blocks: list[BlockId] = field(default_factory=list)
    """Refs held for this sequence while it waits: a prefix pulled or promoted for it, released
    once admission takes its own refs (or under memory pressure, see Scheduler)."""
    num_pulled_tokens: int = 0  # tokens of the pinned prefix that came from a peer
    num_host_tokens: int = 0  # tokens of it promoted from the host tier
    pull_ms: float = 0.0
    pull_source_ms: float = 0.0
    pull_write_ms: float = 0.0
    pull_bytes: int = 0
    dispatch_ms: float = 0.0  # from the coordinator sending it to the worker accepting it
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    num_computed_prompt_tokens: int = 0
    num_preemptions: int = 0
    prefill_started_s: float | None = None  # when a step first ran part of its prompt
    first_token_s: float | None = None
    finish_reason: str = ""
    session_id: str = ""  # the conversation this is a turn of; its chain is kept warm after
    adapter: str = ""  # LoRA adapter it runs with ("" = the base model); also in root_hash
    bypass_cache: bool = False
    """Reuse no cached KV and register none of its own (a request that leaves no trace)."""
    cache_salt: str = ""  # the tenant part of root_hash (a cache reset re-roots waiting requests)
    _matched: tuple[BlockPool, int, int, BlockHash, int, list[BlockId]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # The last `reusable_prefix_in`: (pool, its num_hash_changes, num_tokens, root_hash,
    # block_size, the blocks matched).

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids.tolist() + self.output_ids

    def ids_from(self, start: int) -> list[int]:
        """all_ids[start:] (start >= 0), without copying the whole sequence first: a decode step
        asks for one token of a long one."""
        num_prompt = len(self.prompt_ids)
        if start >= num_prompt:
            return self.output_ids[start - num_prompt :]
        return self.prompt_ids.array[start:].tolist() + self.output_ids

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of all_ids (computed once, extended incrementally)."""
        num_full = self.num_tokens // block_size
        done = len(self.block_hashes)
        if num_full > done:
            parent = self.block_hashes[-1] if done else self.root_hash
            start, stop = done * block_size, num_full * block_size
            tokens: list[int] | np.ndarray
            if stop <= len(self.prompt_ids):
                tokens = self.prompt_ids.array[start:stop]
            else:
                tokens = self.ids_from(start)[: stop - start]
            self.block_hashes.extend(block_hashes(tokens, block_size, parent))
        return self.block_hashes[:num_full]

    def reusable_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of the leading full blocks whose cached KV can be reused (all but the block
        holding the last token: `num_reusable_blocks`), what a prefix match looks up."""
        self.full_block_hashes(block_size)
        return self.block_hashes[: num_reusable_blocks(self.num_tokens, block_size)]

    def reusable_prefix_in(self, pool: BlockPool, block_size: int) -> list[BlockId]:
        """`pool.match_prefix` of `reusable_block_hashes` (refs not taken), looked up again only
        once the pool's hashes, this sequence's tokens or its root have moved: the prefill
        backlog matches a request when it arrives and the scheduler when it admits it, usually
        with nothing registered or evicted between (hundreds of dict lookups saved per hit).
        Exact because the chain is a function of root_hash and all_ids, which only grows, and
        `match_prefix`'s answer changes only with `num_hash_changes`."""
        memo = self._matched
        stamp = pool.num_hash_changes
        if (
            memo is not None
            and memo[0] is pool
            and memo[1:5] == (stamp, self.num_tokens, self.root_hash, block_size)
        ):
            return list(memo[5])
        matched = pool.match_prefix(self.reusable_block_hashes(block_size))
        self._matched = (pool, stamp, self.num_tokens, self.root_hash, block_size, matched)
        return list(matched)

    def parent_hash(self, block_index: int) -> BlockHash:
        return self.block_hashes[block_index - 1] if block_index else self.root_hash

    def reset_for_recompute(self) -> None:
        """After preemption: blocks are gone, everything is recomputed from all_ids."""
        self.block_table = []
        self.relocated = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1

    def prefill_facts(self) -> PrefillFacts:
        """Where its prompt's KV came from, and where the worker's share of its TTFT went, as
        its first output reports them."""
        started = self.prefill_started_s if self.prefill_started_s is not None else self.arrival_s
        cached = self.num_cached_tokens or 0
        pulled = min(self.num_pulled_tokens, cached)
        host = min(self.num_host_tokens, cached - pulled)
        return PrefillFacts(
            local_tokens=cached - pulled - host,
            host_tokens=host,
            pulled_tokens=pulled,
            computed_tokens=self.num_computed_prompt_tokens,
            pull_ms=self.pull_ms,
            pull_source_ms=self.pull_source_ms,
            pull_write_ms=self.pull_write_ms,
            pull_bytes=self.pull_bytes,
            dispatch_ms=self.dispatch_ms,
            queued_ms=(started - self.arrival_s) * 1e3,
            prefill_ms=((self.first_token_s or started) - started) * 1e3,
        )
