"""A prompt's cached tail copied into a run (`block_runs.relocated_tail`, `BlockPool.take_over`,
the scheduler's admission and the worker's copy): which tail, who holds the hashes after, and
that the answer is the same as reading the blocks where they were cached."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import BlockStored
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.kv.block_io import BlockIO
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.kv.block_runs import relocated_tail
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessions
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner

BS = 16


def H(i: int) -> BlockHash:
    return BlockHash(5000 + i)


def _in_runs(table: list[int], f: int) -> bool:
    groups = [table[i : i + f] for i in range(0, len(table), f)]
    return all(g == list(range(g[0], g[0] + len(g))) for g in groups)


# ---- which tail ---------------------------------------------------------------------------------


def test_a_prefix_ending_inside_a_group_relocates_that_groups_blocks() -> None:
    assert relocated_tail([40, 41, 42, 43, 60, 61, 62], 4, 512) == 3
    assert relocated_tail([40, 41, 42, 43, 60], 4, 512) == 1
    assert relocated_tail([40, 41, 42, 43, 60, 61, 62, 63], 4, 512) == 0  # whole groups


def test_a_broken_group_relocates_everything_from_it_on() -> None:
    cached = [40, 41, 42, 43, 60, 61, 9, 15, 22, 23, 24, 25]  # group 1 broken, group 2 a run
    assert relocated_tail(cached, 4, 512) == 8


def test_no_tail_is_copied_for_more_than_the_faster_read_saves_or_without_groups() -> None:
    cached = [40, 41, 42, 43, 60, 61, 62]  # 3 blocks to copy behind 7 cached
    # 3 x 512 pairs a block against new tokens x 7: worth it from 220 new tokens on
    assert relocated_tail(cached, 4, 220) == 3
    assert relocated_tail(cached, 4, 219) == 0
    assert relocated_tail(cached, 1, 512) == 0  # the pool hands out no runs
    assert relocated_tail([], 4, 512) == 0


# ---- who holds the hashes -----------------------------------------------------------------------


def _cached_chain(pool: BlockPool, n: int) -> list[BlockId]:
    """n blocks registered as H(0..n-1) and freed: a cached prefix."""
    blocks = pool.allocate(n)
    assert blocks is not None
    pool.register_run(blocks, [H(i) for i in range(n)], BlockHash(0), depth=1)
    pool.free(blocks)
    pool.drain_events()
    return blocks


def test_a_copy_takes_the_hash_over_and_the_original_is_reused_first() -> None:
    pool = BlockPool(16)
    original = _cached_chain(pool, 3)
    pool.acquire(original[:2])
    copy = pool.allocate(1)
    assert copy is not None and copy[0] not in original
    assert pool.take_over(copy, [H(2)], H(1), depth=3) == 1
    assert pool.match_prefix([H(0), H(1), H(2)]) == [*original[:2], copy[0]]
    assert pool.block_hash(original[2]) is None
    assert pool.drain_events() == []  # the worker holds the same hashes: nothing to announce
    assert pool.allocate(1) == [original[2]]  # unnamed now, first in line
    pool.check_invariants()


def test_a_held_original_gives_its_hash_up_and_keeps_its_reader() -> None:
    pool = BlockPool(16)
    original = _cached_chain(pool, 2)
    pool.acquire(original)  # another sequence reads them
    copy = pool.allocate(1)
    assert copy is not None
    assert pool.take_over(copy, [H(1)], H(0), depth=2) == 1
    assert pool.ref_count(original[1]) == 1 and pool.block_hash(original[1]) is None
    pool.free(original)
    pool.check_invariants()


def test_a_protected_original_keeps_its_hash_and_a_vanished_one_is_registered() -> None:
    pool = BlockPool(16)
    original = _cached_chain(pool, 2)
    pool.protect(original)  # a warm session's chain names these blocks
    copies = pool.allocate(2)
    assert copies is not None
    assert pool.take_over(copies, [H(1), H(9)], H(0), depth=2) == 0
    assert pool.block_hash(copies[0]) is None  # stays unnamed: H(1) is the session's block's
    assert pool.block_hash(copies[1]) == H(9)  # nobody held H(9): registered as usual
    assert [type(e) for e in pool.drain_events()] == [BlockStored]
    pool.check_invariants()


def test_a_protected_original_hands_hash_and_protection_over_where_allowed() -> None:
    pool = BlockPool(16)
    original = _cached_chain(pool, 2)
    pool.protect(original)
    copy = pool.allocate(1)
    assert copy is not None
    moved = pool.take_over(copy, [H(1)], H(0), depth=2, protected_may_move=lambda b: True)
    assert moved == 1 and pool.drain_moved_protection() == [(original[1], copy[0])]
    assert pool.is_protected(copy[0]) and not pool.is_protected(original[1])
    assert pool.block_hash(original[1]) is None and pool.is_protected(original[0])
    pool.free(copy)  # the copy, protected, waits on the warm queue; the original goes first
    assert pool.allocate(1) == [original[1]]
    pool.check_invariants()


def test_a_session_follows_its_block_to_the_copy_and_a_shared_block_stays() -> None:
    pool = BlockPool(16)
    sessions = WarmSessions(pool, WarmSessionConfig(budget_fraction=1.0), 1, lambda: 0.0)
    shared, own = _cached_chain(pool, 1), pool.allocate(1)
    assert own is not None
    pool.register(own[0], H(7), H(0))
    pool.free(own)
    sessions.keep("s", [shared[0], own[0]])
    sessions.keep("t", [shared[0]])
    assert sessions.kept_by_one(own[0]) and not sessions.kept_by_one(shared[0])
    copy = pool.allocate(1)
    assert copy is not None
    pool.take_over(copy, [H(7)], H(0), protected_may_move=sessions.kept_by_one)
    sessions.sync()
    assert sessions.chain("s") == (shared[0], copy[0]) and sessions.chain("t") == (shared[0],)
    pool.free(copy)
    sessions.check_invariants()
    pool.check_invariants()


# ---- admission and the worker's copy ------------------------------------------------------------


class Engine:
    """A CPU worker whose pool hands out runs of `run_blocks` (as with cuDNN's 64-token pages
    over 16-token blocks on a GPU); every step's logits kept."""

    def __init__(self, run_blocks: int, sessions: WarmSessionConfig | None = None) -> None:
        config = preset("tiny-random")
        runner = ModelRunner(config, 128, BS, device="cpu", dtype=torch.float32, seed=0)
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.worker = Worker(
            "w0",
            runner,
            config.fingerprint(),
            SchedulerConfig(BS, 8, 4096),
            logits_sink=lambda rid, row: self.logits[rid].append(row),
            clock=lambda: 0.0,
            sessions=sessions,
        )
        self.worker.pool.run_blocks = run_blocks

    def add(self, rid: str, prompt: list[int], max_tokens: int = 6, session: str = "") -> None:
        sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
        self.worker.add_request(WorkerRequest(rid, tuple(prompt), sampling, session_id=session))

    def drain(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = defaultdict(list)
        while self.worker.has_work:
            for out in self.worker.step():
                tokens[out.request_id] += out.new_token_ids
            self.worker.check_invariants()
        return tokens


SHARED = [(i * 7) % 250 + 3 for i in range(88)]  # 5 whole blocks and 8 tokens: ends in group 1


def _prompt(seed: int, n: int) -> list[int]:
    return SHARED + [(i * 13 + seed * 31) % 250 + 3 for i in range(n)]


def test_a_hit_whose_prefix_ends_inside_a_group_reads_it_from_copies_in_one_run() -> None:
    runs, plain = Engine(4), Engine(1)
    for engine in (runs, plain):
        engine.add("a", _prompt(1, 40))
        engine.drain()
        engine.add("b", _prompt(2, 120))
    worker = runs.worker
    cached = worker.pool.match_prefix(worker._seqs["b"].full_block_hashes(BS))
    assert len(cached) == 5  # the shared 5 blocks: the fifth is group 1's first
    first = worker.step()  # b's prefill: the fifth block's KV copied into b's run first
    seq = worker._seqs["b"]
    assert seq.block_table[:4] == cached[:4] and seq.block_table[4] != cached[4]
    assert _in_runs(seq.block_table, 4)
    assert worker.info().counters.num_relocated_blocks == 1
    assert plain.worker.info().counters.num_relocated_blocks == 0
    assert worker.pool.match_prefix(seq.full_block_hashes(BS)[:5])[4] == seq.block_table[4]
    tokens = {"runs": runs.drain(), "plain": plain.drain()}
    assert [*first[0].new_token_ids, *tokens["runs"]["b"]] == tokens["plain"]["b"]
    assert len(runs.logits["b"]) == len(plain.logits["b"]) == 6
    for mine, theirs in zip(runs.logits["b"], plain.logits["b"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert plain.worker.scheduler.running == [] and not plain.worker._seqs


def test_the_next_turn_finds_the_copies_and_reads_them_again() -> None:
    runs, plain = Engine(4), Engine(1)
    for engine in (runs, plain):
        engine.add("a", _prompt(1, 40))
        engine.drain()
        engine.add("b", _prompt(2, 120))  # relocates the shared prefix's fifth block
        engine.drain()
        engine.add("c", _prompt(2, 120) + [9] * 100)  # b's prompt quoted, 100 tokens more
    c_cached = runs.worker.pool.match_prefix(runs.worker._seqs["c"].full_block_hashes(BS))
    assert _in_runs(c_cached[:12], 4)  # b's prompt blocks: the copies took the hashes over
    tokens = {"runs": runs.drain(), "plain": plain.drain()}
    assert tokens["runs"]["c"] == tokens["plain"]["c"]
    for mine, theirs in zip(runs.logits["c"], plain.logits["c"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_no_copy_where_the_new_blocks_would_break_the_run_all_the_same() -> None:
    """On a busy pool the new blocks come in pieces; a copy then buys no faster read and only
    holds a second block as long as the sequence runs (on a busy worker, cached tokens lost)."""
    engine = Engine(4)
    engine.add("a", _prompt(1, 40))
    engine.drain()
    pool = engine.worker.pool
    held = pool.allocate(pool.num_free - 9)  # all but the 9 newest free blocks (a's)
    assert held is not None
    pool.free(held[::2])  # every other one free: the queue's head is pieces
    engine.add("b", _prompt(2, 120))
    cached = pool.match_prefix(engine.worker._seqs["b"].full_block_hashes(BS))
    engine.worker.step()
    seq = engine.worker._seqs["b"]
    assert seq.block_table[:5] == cached and not seq.relocated
    assert not _in_runs(seq.block_table, 4)
    assert engine.worker.info().counters.num_relocated_blocks == 0
    pool.free(held[1::2])
    engine.drain()


def test_a_tail_still_being_written_is_read_where_it_lies() -> None:
    engine = Engine(4)
    engine.add("a", _prompt(1, 40))
    engine.drain()
    engine.worker.scheduler.can_relocate = lambda blocks: False
    engine.add("b", _prompt(2, 120))
    cached = engine.worker.pool.match_prefix(engine.worker._seqs["b"].full_block_hashes(BS))
    engine.worker.step()
    seq = engine.worker._seqs["b"]
    assert seq.block_table[:5] == cached and not seq.relocated
    engine.drain()


def test_a_copy_within_the_cache_moves_every_layer_of_each_pair_and_refuses_overlap() -> None:
    cache = torch.randn(3, 2, 32, BS, 2, 4)  # layers, K/V, blocks, slots, heads, dim
    io = BlockIO(cache, gates=None, layered=False)
    for src, dst in (([4, 5, 6], [20, 21, 22]), ([1, 9, 3, 12, 7, 30], [14, 15, 16, 17, 18, 19])):
        before = cache.clone()
        io.copy_within(src, dst)
        assert torch.equal(cache[:, :, dst], before[:, :, src])
        untouched = [b for b in range(32) if b not in dst]
        assert torch.equal(cache[:, :, untouched], before[:, :, untouched])
    with pytest.raises(ValueError, match="both read and written"):
        io.copy_within([2, 3], [3, 4])


def test_a_second_turn_quoting_an_answer_decoded_beside_another_reads_it_in_one_run() -> None:
    runs, plain = Engine(4), Engine(1)
    answers: dict[str, list[int]] = {}
    for name, engine in (("runs", runs), ("plain", plain)):
        engine.add("a", _prompt(1, 40), max_tokens=40)  # two answers decoded side by side:
        engine.add("z", _prompt(3, 40), max_tokens=40)  # their blocks alternate in the pool
        answers[name] = engine.drain()["a"]
    assert answers["runs"] == answers["plain"]
    turn_2 = _prompt(1, 40) + answers["runs"] + [(i * 5) % 250 + 3 for i in range(200)]
    for engine in (runs, plain):
        engine.add("b", turn_2)
    seq = runs.worker._seqs["b"]
    cached = runs.worker.pool.match_prefix(seq.full_block_hashes(BS))
    assert len(cached) == len(_prompt(1, 40) + answers["runs"]) // BS
    assert not _in_runs(cached, 4)  # the answer's blocks break the prompt's run
    first = runs.worker.step()
    assert seq.relocated == [] and _in_runs(seq.block_table, 4)
    tokens = {"runs": runs.drain(), "plain": plain.drain()}
    assert [*first[0].new_token_ids, *tokens["runs"]["b"]] == tokens["plain"]["b"]
    for mine, theirs in zip(runs.logits["b"], plain.logits["b"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_warm_sessions_turns_each_copy_only_what_broke_the_run_before_them() -> None:
    kept = WarmSessionConfig(budget_fraction=1.0)
    runs, plain = Engine(4, kept), Engine(4, kept)
    plain.worker.scheduler.can_relocate = lambda blocks: False
    prompt = _prompt(1, 40)
    copied: list[int] = []
    for turn in range(3):
        answers = {}
        for engine in (runs, plain):
            engine.add(f"t{turn}", prompt, max_tokens=24, session="s")
            engine.add(f"o{turn}", _prompt(9 + turn, 40), max_tokens=24)  # decoded beside it
            worker = engine.worker
            seq = worker._seqs[f"t{turn}"]
            cached = worker.pool.match_prefix(seq.full_block_hashes(BS))
            first = worker.step()  # both prefills
            if engine is runs:
                table = seq.block_table[: len(cached)]
                kept_in_place = next(
                    (i for i, (a, b) in enumerate(zip(cached, table, strict=True)) if a != b),
                    len(cached),
                )
                copied.append(len(cached) - kept_in_place)
                assert _in_runs(seq.block_table, 4)
            tokens = engine.drain()
            answers[engine] = [
                *(t for o in first if o.request_id == f"t{turn}" for t in o.new_token_ids),
                *tokens[f"t{turn}"],
            ]
            worker.sessions.check_invariants()
        assert answers[runs] == answers[plain]
        prompt = prompt + answers[runs] + [(i * 3 + turn) % 250 + 3 for i in range(200)]
    # turn 1 copies turn 0's answer and the group before it; turn 2 only turn 1's answer on:
    # the copies took the session's hashes and protection over, so its chain stays in runs
    assert copied[0] == 0 and 0 < copied[1] and 0 < copied[2] <= -(-(24 + 16 * 3) // BS)
    chain = list(runs.worker.sessions.chain("s"))
    assert _in_runs(chain[: len(chain) - len(chain) % 4], 4)
    for mine, theirs in zip(runs.logits["t2"], plain.logits["t2"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
