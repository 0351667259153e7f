from __future__ import annotations

import pytest

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _chain(pool: BlockPool, tag: int, n: int) -> list[BlockId]:
    """A finished turn: n registered blocks, freed tail first."""
    blocks = pool.allocate(n)
    assert blocks is not None
    parent = BlockHash(0)
    for i, b in enumerate(blocks):
        h = BlockHash(tag * 1000 + i + 1)
        pool.register(b, h, parent)
        parent = h
    pool.free(blocks)
    return blocks


def _hashes(tag: int, n: int) -> list[BlockHash]:
    return [BlockHash(tag * 1000 + i + 1) for i in range(n)]


def _sessions(
    num_blocks: int = 16, budget_blocks: int = 8, ttl_s: float = 60.0
) -> tuple[BlockPool, WarmSessions, Clock]:
    clock = Clock()
    pool = BlockPool(num_blocks)
    config = WarmSessionConfig(idle_ttl_s=ttl_s, budget_bytes=budget_blocks * 100)
    return pool, WarmSessions(pool, config, 100, clock), clock


def _check(warm: WarmSessions) -> None:
    warm.sync()
    warm.check_invariants()
    warm.pool.check_invariants()


def test_protected_chain_outlives_every_ordinary_free_block() -> None:
    pool = BlockPool(8)
    kept = _chain(pool, 1, 3)
    pool.protect(kept)
    _chain(pool, 2, 3)  # freed later: LRU alone would keep it longer than the protected chain
    pool.check_invariants()
    assert pool.allocate(5) is not None  # 2 unhashed + the later chain, never the warm one
    assert pool.match_prefix(_hashes(1, 3)) == kept
    assert pool.match_prefix(_hashes(2, 3)) == []
    pool.check_invariants()


def test_warm_blocks_are_allocated_tail_first_once_nothing_else_is_free() -> None:
    pool = BlockPool(4)
    kept = _chain(pool, 1, 4)
    pool.protect(kept)
    assert pool.allocate(1) is not None
    assert pool.match_prefix(_hashes(1, 4)) == kept[:3]
    assert pool.drain_lost_protection() == [kept[3]]
    pool.check_invariants()


def test_protect_refuses_an_unregistered_block() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    assert blocks is not None
    with pytest.raises(ValueError, match="not registered"):
        pool.protect(blocks)


def test_unprotected_chain_goes_first_tail_before_root() -> None:
    pool = BlockPool(6)
    kept = _chain(pool, 1, 3)
    pool.protect(kept)
    other = _chain(pool, 2, 3)
    pool.unprotect(kept)
    pool.check_invariants()
    assert pool.allocate(1) is not None
    assert pool.match_prefix(_hashes(1, 3)) == kept[:2]
    assert pool.match_prefix(_hashes(2, 3)) == other


def test_session_kept_after_its_turn_hits_after_other_traffic() -> None:
    pool, warm, clock = _sessions()
    chain = _chain(pool, 1, 4)
    warm.keep("chat", chain)
    _check(warm)
    clock.t = 30.0
    for tag in range(2, 6):  # other requests cycle the rest of the pool
        _chain(pool, tag, 6)
        _check(warm)
    assert pool.match_prefix(_hashes(1, 4)) == chain
    assert warm.stats().num_sessions == 1


def test_idle_session_expires_after_its_ttl() -> None:
    pool, warm, clock = _sessions(ttl_s=60.0)
    warm.keep("chat", _chain(pool, 1, 4))
    clock.t = 59.0
    assert warm.expire() == 0
    clock.t = 60.0
    assert warm.expire() == 1
    _check(warm)
    stats = warm.stats()
    assert (stats.num_sessions, stats.num_evicted_ttl, pool.num_protected) == (0, 1, 0)
    assert pool.match_prefix(_hashes(1, 4)) != []  # still cached, just no longer warm


def test_budget_lets_the_least_recently_kept_session_go() -> None:
    pool, warm, clock = _sessions(num_blocks=16, budget_blocks=8)
    a = _chain(pool, 1, 4)
    warm.keep("a", a)
    clock.t = 1.0
    warm.keep("b", _chain(pool, 2, 4))
    clock.t = 2.0
    warm.keep("a", a)  # a's next turn: a is now the most recent
    clock.t = 3.0
    warm.keep("c", _chain(pool, 3, 4))
    _check(warm)
    assert "b" not in warm and "a" in warm and "c" in warm
    stats = warm.stats()
    assert (stats.num_evicted_budget, stats.num_blocks, stats.num_bytes) == (1, 8, 800)


def test_next_turn_replaces_the_chain_and_shared_blocks_count_once() -> None:
    pool, warm, clock = _sessions(num_blocks=16, budget_blocks=8)
    first = _chain(pool, 1, 3)
    warm.keep("a", first)
    warm.keep("b", first[:2])  # shares a's first two blocks (a system prompt)
    _check(warm)
    assert warm.num_blocks == 3
    warm.keep("a", first[:1])
    _check(warm)
    assert warm.num_blocks == 2
    assert not pool.is_protected(first[2])


def test_pressure_cuts_a_chain_where_the_pool_took_a_block() -> None:
    pool, warm, clock = _sessions(num_blocks=4, budget_blocks=4)
    chain = _chain(pool, 1, 4)
    warm.keep("chat", chain)
    assert pool.allocate(1) is not None
    _check(warm)
    assert warm.chain("chat") == tuple(chain[:3])
    assert pool.allocate(3) is not None
    _check(warm)
    stats = warm.stats()
    assert (stats.num_sessions, stats.num_evicted_pressure) == (0, 1)


def test_chain_over_the_whole_budget_keeps_its_leading_part() -> None:
    pool, warm, _ = _sessions(num_blocks=16, budget_blocks=3)
    chain = _chain(pool, 1, 5)
    warm.keep("chat", chain)
    _check(warm)
    assert warm.chain("chat") == tuple(chain[:3])


def test_zero_budget_keeps_nothing() -> None:
    clock = Clock()
    pool = BlockPool(8)
    warm = WarmSessions(pool, WarmSessionConfig(budget_fraction=0.0), 100, clock)
    warm.keep("chat", _chain(pool, 1, 2))
    assert warm.num_sessions == 0 and pool.num_protected == 0


def test_clear_cache_ends_protection() -> None:
    pool, warm, _ = _sessions()
    warm.keep("chat", _chain(pool, 1, 3))
    pool.evict_all_free()
    _check(warm)
    assert warm.num_sessions == 0


@pytest.mark.parametrize(
    "kwargs", [{"idle_ttl_s": 0.0}, {"budget_fraction": 1.5}, {"budget_bytes": -1}]
)
def test_config_refuses_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WarmSessionConfig(**kwargs)  # type: ignore[arg-type]


def test_budget_displaced_session_rejoins_lru_as_if_just_freed() -> None:
    pool, warm, clock = _sessions(num_blocks=12, budget_blocks=4)
    older = _chain(pool, 9, 4)  # an ordinary chain freed before the sessions
    a = _chain(pool, 1, 4)
    warm.keep("a", a)
    clock.t = 1.0
    warm.keep("b", _chain(pool, 2, 4))  # over budget: a is let go, but is newer than `older`
    _check(warm)
    assert "a" not in warm and warm.num_evicted_budget == 1
    assert pool.allocate(4) is not None  # takes the ordinary chain freed first
    assert pool.match_prefix(_hashes(1, 4)) == a
    assert pool.match_prefix(_hashes(9, 4)) == []
    del older
