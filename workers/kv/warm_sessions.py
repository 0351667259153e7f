"""Warm idle sessions: after a turn, the session's chain stays matchable ahead of ordinary free
blocks, for an idle TTL and within a per-worker byte budget.

    turn of session s ends  -> keep(s, chain)      chain protected in the pool (warm queue)
    s idle >= idle_ttl_s    -> expire()            chain unprotected, first to go      (TTL)
    kept chains > budget    -> least recently kept sessions unprotected first: they
                               rejoin plain LRU as if just freed                 (budget)
    pool has nothing else   -> the pool reallocates warm blocks, LRU first        (pressure)

Unprotected or reallocated blocks are what the host tier catches (the pool reports every
registered block it reallocates). Sessions share blocks (a system prompt): a block is protected
while any kept session's chain holds it, and counted once in the budget.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.workers.kv.block_pool import BlockId, BlockPool


@dataclass(frozen=True, slots=True)
class WarmSessionConfig:
    """How long, and how much of a worker's device pool, idle sessions are kept warm."""

    idle_ttl_s: float = 300.0
    """A session idle this long (since its last turn ended) is no longer kept warm; its blocks
    become ordinary free blocks (still matchable until reused)."""
    budget_fraction: float = 0.5
    """Share of the device pool that idle sessions may keep warm, when `budget_bytes` is 0;
    0 turns warm sessions off."""
    budget_bytes: int = 0
    """Per-worker budget of kept KV bytes; 0: `budget_fraction` of the pool."""

    def __post_init__(self) -> None:
        if not (self.idle_ttl_s > 0 and math.isfinite(self.idle_ttl_s)):
            raise ValueError(f"idle_ttl_s must be a finite number > 0, got {self.idle_ttl_s}")
        if not 0.0 <= self.budget_fraction <= 1.0:
            raise ValueError(f"budget_fraction must be in [0, 1], got {self.budget_fraction}")
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")

    def budget_blocks(self, num_blocks: int, block_num_bytes: int) -> int:
        """The budget in blocks of a pool of `num_blocks` blocks of `block_num_bytes` each."""
        if self.budget_bytes:
            return min(num_blocks, self.budget_bytes // max(1, block_num_bytes))
        return int(num_blocks * self.budget_fraction)


@dataclass(frozen=True, slots=True)
class WarmSessionStats:
    num_sessions: int
    """Idle (or running) sessions whose chains are kept warm."""
    num_blocks: int
    """Distinct blocks kept warm."""
    num_bytes: int
    num_evicted_ttl: int
    """Sessions let go for having been idle `idle_ttl_s`."""
    num_evicted_budget: int
    """Sessions let go, least recently used first, to stay within the budget."""
    num_evicted_pressure: int
    """Sessions whose whole chain the pool reallocated (it had nothing else to give)."""


class WarmSessions:
    """The sessions a worker keeps warm in its `BlockPool`, least recently kept first.

    Invariants (checked by `check_invariants`, after `sync`):
      * a block is protected in the pool iff some kept session's chain holds it
      * owners[b] is exactly the set of kept sessions whose chain holds b
      * num_blocks == len(owners) <= budget_blocks; every kept chain is non-empty
      * no kept session has been idle `idle_ttl_s` once `expire` ran
    """

    def __init__(
        self,
        pool: BlockPool,
        config: WarmSessionConfig,
        block_num_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        if block_num_bytes < 1:
            raise ValueError(f"block_num_bytes must be >= 1, got {block_num_bytes}")
        self.pool = pool
        self.config = config
        self.block_num_bytes = block_num_bytes
        self.budget_blocks = config.budget_blocks(pool.num_blocks, block_num_bytes)
        self._clock = clock  # seconds
        # session -> (chain, last turn end); insertion order is LRU order (first = oldest).
        self._sessions: OrderedDict[str, tuple[tuple[BlockId, ...], float]] = OrderedDict()
        self._owners: dict[BlockId, set[str]] = {}
        self.num_evicted_ttl = 0
        self.num_evicted_budget = 0
        self.num_evicted_pressure = 0

    @property
    def enabled(self) -> bool:
        return self.budget_blocks > 0

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_blocks(self) -> int:
        return len(self._owners)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def chain(self, session_id: str) -> tuple[BlockId, ...]:
        entry = self._sessions.get(session_id)
        return entry[0] if entry is not None else ()

    def keep(self, session_id: str, chain: Sequence[BlockId]) -> None:
        """A turn of `session_id` ended: keep its registered chain (in chain order) warm,
        replacing the one kept before. A chain over the whole budget keeps its leading part."""
        if not session_id or not self.enabled:
            return
        self.sync()
        chain = tuple(chain[: self.budget_blocks])
        old = self._sessions.pop(session_id, None)
        if chain:
            for b in chain:
                self._owners.setdefault(b, set()).add(session_id)
            self.pool.protect(chain)
            self._sessions[session_id] = (chain, self._clock())
        if old is not None:
            kept = set(chain)
            self._release(session_id, [b for b in old[0] if b not in kept])
        while len(self._owners) > self.budget_blocks:
            oldest = next(iter(self._sessions))
            # Recent enough to deserve LRU's chance: only the budget, not idleness, let it go.
            self._drop(oldest, evict_first=False)
            self.num_evicted_budget += 1

    def expire(self) -> int:
        """Let go of sessions idle for `idle_ttl_s`; returns how many."""
        self.sync()
        deadline = self._clock() - self.config.idle_ttl_s
        num_expired = 0
        while self._sessions:
            session_id, (_chain, last_s) = next(iter(self._sessions.items()))
            if last_s > deadline:
                break
            self._drop(session_id)
            num_expired += 1
        self.num_evicted_ttl += num_expired
        return num_expired

    def kept_by_one(self, block: BlockId) -> bool:
        """Whether exactly one kept session's chain holds `block`: a copy may take its hash and
        protection over (`BlockPool.take_over`), renaming one chain, not every session that
        shares a system prompt."""
        return len(self._owners.get(block, ())) == 1

    def sync(self) -> None:
        """Follow the pool: a protected block whose copy took it over is renamed in the chain
        holding it; a protected block it reallocated cuts every chain holding it there (what
        follows can no longer be matched, so it is let go too)."""
        for old, new in self.pool.drain_moved_protection():
            for session_id in self._owners.pop(old, ()):
                chain, last_s = self._sessions[session_id]
                self._sessions[session_id] = (tuple(new if b == old else b for b in chain), last_s)
                self._owners.setdefault(new, set()).add(session_id)
        lost_blocks = self.pool.drain_lost_protection()
        for lost in lost_blocks:
            for session_id in list(self._owners.pop(lost, ())):
                chain, last_s = self._sessions.pop(session_id)
                cut = chain.index(lost)
                self._release(session_id, chain[cut + 1 :])
                if cut:
                    self._sessions[session_id] = (chain[:cut], last_s)
                    self._sessions.move_to_end(session_id, last=False)
                else:
                    self.num_evicted_pressure += 1
        if lost_blocks:  # cut chains went back in: restore LRU order by last turn
            ordered = sorted(self._sessions.items(), key=lambda kv: kv[1][1])
            self._sessions = OrderedDict(ordered)

    def stats(self) -> WarmSessionStats:
        self.sync()
        return WarmSessionStats(
            num_sessions=len(self._sessions),
            num_blocks=len(self._owners),
            num_bytes=len(self._owners) * self.block_num_bytes,
            num_evicted_ttl=self.num_evicted_ttl,
            num_evicted_budget=self.num_evicted_budget,
            num_evicted_pressure=self.num_evicted_pressure,
        )

    def _drop(self, session_id: str, evict_first: bool = True) -> None:
        chain, _ = self._sessions.pop(session_id)
        self._release(session_id, chain, evict_first)

    def _release(
        self, session_id: str, blocks: Sequence[BlockId], evict_first: bool = True
    ) -> None:
        """Drop `session_id`'s ownership of `blocks`; unprotect those nobody else keeps."""
        unowned = []
        for b in blocks:
            owners = self._owners.get(b)
            if owners is None or session_id not in owners:
                continue
            owners.discard(session_id)
            if not owners:
                del self._owners[b]
                unowned.append(b)
        self.pool.unprotect(unowned, evict_first=evict_first)

    def check_invariants(self) -> None:
        owners: dict[BlockId, set[str]] = {}
        last = -math.inf
        for session_id, (chain, last_s) in self._sessions.items():
            assert chain, f"session {session_id!r} kept with an empty chain"
            assert last_s >= last, f"session {session_id!r} out of LRU order"
            last = last_s
            for b in chain:
                owners.setdefault(b, set()).add(session_id)
        assert owners == self._owners, "owners do not match the kept chains"
        assert len(self._owners) <= max(self.budget_blocks, 0)
        for i in range(self.pool.num_blocks):
            block = BlockId(i)
            assert self.pool.is_protected(block) == (block in self._owners), f"block {i}"
