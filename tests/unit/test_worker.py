"""The worker engine (pool + scheduler + runner) without Ray: reuse must not change results."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from kvmesh.proto.request_notes import RequestFinished, RequestPrefilled, RequestTaken
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.tally import WorkerTally
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig, WarmSessionStats
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner, SeqChunk

BS = 16


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        sessions: WarmSessionConfig | None = None,
    ) -> None:
        config = preset("tiny-random")
        self.now_s = 0.0
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        runner = ModelRunner(config, num_blocks, BS, device="cpu", dtype=torch.float32, seed=0)
        self.worker = Worker(
            "w0",
            runner,
            config.fingerprint(),
            SchedulerConfig(BS, max_num_seqs, 4096),
            eos_token_ids=(),
            logits_sink=lambda rid, row: self.logits[rid].append(row),
            clock=lambda: self.now_s,
            sessions=sessions,
        )

    def run(self, requests: list[WorkerRequest]) -> dict[str, list[RequestOutput]]:
        for r in requests:
            self.worker.add_request(r)
        outs: dict[str, list[RequestOutput]] = defaultdict(list)
        while self.worker.has_work:
            for o in self.worker.step():
                outs[o.request_id].append(o)
            self.worker.check_invariants()
        return outs


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> WorkerRequest:
    return WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, ignore_eos=True))


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


PREFIX = [(i * 7) % 250 + 3 for i in range(64)]  # 4 full blocks


def test_cached_prefix_gives_the_same_tokens_and_logits_as_a_cold_run() -> None:
    warm = Harness()
    warm.run([req("first", PREFIX + [1, 2, 3])])
    second = PREFIX + [9, 8, 7, 6, 5]
    out = warm.run([req("second", second)])
    assert out["second"][0].prefill.local_tokens == 64
    assert out["second"][0].prefill.computed_tokens == len(second) - 64

    cold = Harness()
    cold_out = cold.run([req("second", second)])
    assert cold_out["second"][0].prefill.local_tokens == 0
    assert tokens(out["second"]) == tokens(cold_out["second"])
    for a, b in zip(warm.logits["second"], cold.logits["second"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_evicted_prefix_is_recomputed_with_the_same_result() -> None:
    h = Harness(num_blocks=12)  # 192 tokens: the filler below evicts the prefix
    h.run([req("a", PREFIX + [1])])
    filler = [[(i * 13 + k) % 250 + 3 for i in range(150)] for k in range(2)]
    h.run([req(f"f{k}", f, max_tokens=4) for k, f in enumerate(filler)])
    out = h.run([req("b", PREFIX + [1], max_tokens=6)])
    assert out["b"][0].prefill.local_tokens < 64  # at least part of it was evicted
    cold = Harness()
    cold_out = cold.run([req("b", PREFIX + [1], max_tokens=6)])
    assert tokens(out["b"]) == tokens(cold_out["b"])
    for a, b in zip(h.logits["b"], cold.logits["b"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    h = Harness()
    h.run([req("a", PREFIX)])
    out = h.run([req("b", PREFIX)])
    assert out["b"][0].prefill.local_tokens == 48  # the last block is recomputed for its logits
    assert out["b"][0].prefill.computed_tokens == 16


def test_batched_requests_match_running_alone_and_leave_no_block_referenced() -> None:
    prompts = [PREFIX[: 20 + 9 * k] for k in range(5)]
    together = Harness(num_blocks=40, max_num_seqs=3)
    outs = together.run([req(f"r{k}", p, max_tokens=10) for k, p in enumerate(prompts)])
    for k, p in enumerate(prompts):
        alone = Harness().run([req("x", p, max_tokens=10)])
        assert tokens(outs[f"r{k}"]) == tokens(alone["x"])
    pool = together.worker.pool
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_preemption_under_pressure_still_finishes_everything_correctly() -> None:
    prompts = [[(i * (k + 3)) % 250 + 3 for i in range(40)] for k in range(4)]
    tight = Harness(num_blocks=14, max_num_seqs=4)  # 4 x (40 + 40) tokens cannot all fit
    outs = tight.run([req(f"r{k}", p, max_tokens=40) for k, p in enumerate(prompts)])
    assert tight.worker.scheduler.num_preemptions > 0
    for k, p in enumerate(prompts):
        alone = Harness().run([req("x", p, max_tokens=40)])
        assert tokens(outs[f"r{k}"]) == tokens(alone["x"])
    assert tight.worker.pool.num_free == tight.worker.pool.num_blocks


def test_generated_blocks_are_registered_for_the_next_turn() -> None:
    h = Harness()
    out = h.run([req("t1", PREFIX[:30], max_tokens=20)])
    turn2 = PREFIX[:30] + tokens(out["t1"]) + [5, 6, 7]
    out2 = h.run([req("t2", turn2)])
    # 30 prompt + 19 generated tokens had KV written: 3 full blocks.
    assert out2["t2"][0].prefill.local_tokens == 48


def test_events_describe_the_pool() -> None:
    h = Harness(num_blocks=12)
    h.run([req("a", PREFIX + [1])])
    batch = h.worker.drain_event_batch()
    assert batch is not None and batch.seq == 1
    stored = {x for e in batch.events for x in getattr(e, "hashes", ())}
    assert stored == set(h.worker.pool.cached_hashes())
    full = h.worker.full_state_batch()
    assert full.seq == 1 and full.generation != batch.generation


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [([], 4, "empty"), ([1, 99999], 4, "vocabulary"), ([1, 2], 5000, "context")],
)
def test_bad_requests_are_refused(prompt: list[int], max_tokens: int, match: str) -> None:
    h = Harness()
    with pytest.raises(ValueError, match=match):
        h.worker.add_request(req("bad", prompt, max_tokens))
    assert not h.worker.has_work


def test_request_larger_than_the_pool_is_refused() -> None:
    h = Harness(num_blocks=4)
    with pytest.raises(ValueError, match="KV pool"):
        h.worker.add_request(req("big", PREFIX + [1], max_tokens=10))


# ---- isolation: one sequence's failure is its own ----------------------------------------------

POISON = 299  # a prompt holding this token makes FaultyRunner's forward pass raise


class FaultyRunner(ModelRunner):
    """The real runner, except that a batch holding POISON fails (a bug one request triggers)."""

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        if any(POISON in c.token_ids for c in chunks):
            raise RuntimeError("kernel fault")
        return super().forward(chunks)


@pytest.mark.parametrize(
    "fields",
    [{"min_p": float("inf")}, {"top_k": -5}, {"temperature": float("nan")}],
)
def test_a_sequence_whose_sampling_fails_fails_alone(fields: dict[str, float]) -> None:
    prompts = [PREFIX[: 20 + 9 * k] for k in range(3)]
    h = Harness()
    for k, p in enumerate(prompts):
        h.worker.add_request(req(f"r{k}", p, 10))
    sampling = SamplingConfig(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    h.worker.add_request(WorkerRequest("bad", tuple(PREFIX[:25]), sampling))
    with pytest.raises(ValueError):
        SamplingConfig(**{**{"temperature": 1.0}, **fields})  # type: ignore[arg-type]
    for name, value in fields.items():  # as if validation had been skipped (a bug upstream)
        object.__setattr__(sampling, name, value)
    outs = h.run([])
    (last,) = outs["bad"]
    assert last.finished and last.failure is not None and not last.failure.internal
    assert last.finish_reason == "error" and not last.new_token_ids
    for k, p in enumerate(prompts):
        assert tokens(outs[f"r{k}"]) == tokens(Harness().run([req("x", p, 10)])["x"])
    assert h.worker.pool.num_free == h.worker.pool.num_blocks
    assert h.worker.info().counters.num_failed == 1


def test_the_worker_refuses_sampling_parameters_that_skipped_validation() -> None:
    sampling = SamplingConfig(max_tokens=4, temperature=1.0)
    object.__setattr__(sampling, "top_p", float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        Harness().worker.add_request(WorkerRequest("x", (1, 2, 3), sampling))


def test_a_forward_pass_failure_fails_only_the_sequence_that_causes_it() -> None:
    config = preset("tiny-random")
    runner = FaultyRunner(config, 64, BS, device="cpu", dtype=torch.float32, seed=0)
    worker = Worker("w0", runner, config.fingerprint(), SchedulerConfig(BS, 8, 4096))
    prompts = [PREFIX[: 20 + 9 * k] for k in range(3)]
    for k, p in enumerate(prompts):
        worker.add_request(req(f"r{k}", p, 10))
    worker.add_request(req("poison", PREFIX[:30] + [POISON]))
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    while worker.has_work:
        for o in worker.step():
            outs[o.request_id].append(o)
        worker.check_invariants()
    (last,) = outs["poison"]
    assert last.failure is not None and last.failure.internal and "kernel" not in str(last)
    for k, p in enumerate(prompts):
        assert tokens(outs[f"r{k}"]) == tokens(Harness().run([req("x", p, 10)])["x"])
    assert worker.pool.num_free == worker.pool.num_blocks


def _churn(h: Harness, num_requests: int) -> None:
    """Unrelated one-off requests that cycle every ordinary free block of a 64-block pool."""
    for i in range(num_requests):
        prompt = [(i * 31 + j * 13) % 250 + 3 for j in range(120)]
        h.run([req(f"churn{i}", prompt)])


def _turn(rid: str, prompt: list[int], session_id: str) -> WorkerRequest:
    return WorkerRequest(
        rid,
        tuple(prompt),
        SamplingConfig(max_tokens=8, ignore_eos=True),
        session_id=session_id,
    )


@pytest.mark.parametrize("session_id", ["chat", ""])
def test_idle_session_next_turn_hits_after_churn_evicts_other_free_blocks(session_id: str) -> None:
    h = Harness(sessions=WarmSessionConfig(idle_ttl_s=60.0, budget_fraction=0.25))
    first = h.run([_turn("t1", PREFIX, session_id)])
    h.now_s = 30.0
    _churn(h, 10)
    second = h.run([_turn("t2", PREFIX + tokens(first["t1"]) + [5, 6, 7], session_id)])
    local = second["t2"][0].prefill.local_tokens
    if session_id:
        assert local == 64  # the whole first prompt (its answer's block was never full)
        assert h.worker.info().counters.num_warm_sessions == 1
    else:
        assert local == 0  # plain LRU: the churn took every block of the first turn


def test_idle_session_past_its_ttl_is_an_ordinary_free_chain() -> None:
    h = Harness(sessions=WarmSessionConfig(idle_ttl_s=10.0, budget_fraction=0.25))
    h.run([_turn("t1", PREFIX, "chat")])
    h.now_s = 11.0
    _churn(h, 10)
    counters = h.worker.info().counters
    assert (counters.num_warm_sessions, counters.num_sessions_evicted_ttl) == (0, 1)
    out = h.run([_turn("t2", PREFIX + [5, 6, 7], "chat")])
    assert out["t2"][0].prefill.local_tokens == 0


def test_the_worker_notes_each_request_it_takes_prefills_and_finishes() -> None:
    h = Harness()
    prompt = [(i * 7) % 200 + 1 for i in range(40)]  # 2 full blocks + 8
    first = WorkerRequest("a", tuple(prompt), SamplingConfig(max_tokens=2), origin="c1")
    h.run([first])
    notes = h.worker.drain_request_notes()
    assert notes is not None and notes.worker_id == "w0"
    assert notes.notes == (
        RequestTaken("a", "c1", 40, 40),
        RequestPrefilled("a"),
        RequestFinished("a"),
    )
    h.worker.add_request(req("b", prompt))  # its 2 full blocks are held now
    h.worker.abort("b")
    notes = h.worker.drain_request_notes()
    assert notes is not None
    assert notes.notes == (RequestTaken("b", "", 40, 40 - 2 * BS), RequestFinished("b"))
    assert h.worker.drain_request_notes() is None


def test_prefill_facts_split_the_wait_for_a_step_from_the_prefill() -> None:
    h = Harness(max_num_seqs=1)  # the second request waits for the first to finish
    h.worker.add_request(req("a", PREFIX + [1], max_tokens=3))
    h.worker.add_request(req("b", PREFIX + [2], max_tokens=1))
    firsts: dict[str, RequestOutput] = {}
    while h.worker.has_work:
        for o in h.worker.step():
            firsts.setdefault(o.request_id, o)
        h.now_s += 1.0  # each step takes a second of the worker's clock
    a, b = firsts["a"].prefill, firsts["b"].prefill
    assert a is not None and b is not None
    assert (a.queued_ms, a.prefill_ms) == (0.0, 0.0)
    assert (b.queued_ms, b.prefill_ms) == (3000.0, 0.0)  # a's prefill and two decode steps


def test_prefill_facts_say_how_long_a_stamped_request_took_to_reach_the_worker() -> None:
    h = Harness()
    h.worker.wall_clock = lambda: 1000.0
    stamped = replace(req("a", PREFIX + [1], max_tokens=1), sent_at_s=999.75)
    h.worker.add_request(stamped)
    h.worker.add_request(req("b", PREFIX + [2], max_tokens=1))  # not stamped
    # c was accepted 2 s (of the worker's clock) before the engine took it: that wait is
    # queueing, not its way to the worker
    late = replace(req("c", PREFIX + [3], max_tokens=1), sent_at_s=997.75)
    h.worker.add_request(late, accepted_s=h.now_s - 2.0)
    firsts = {o.request_id: o.prefill for o in h.worker.step()}
    a, b, c = firsts["a"], firsts["b"], firsts["c"]
    assert a is not None and b is not None and c is not None
    assert a.dispatch_ms == pytest.approx(250.0)  # sent a quarter second before it arrived
    assert b.dispatch_ms == 0.0
    assert c.dispatch_ms == pytest.approx(250.0)
    assert (a.queued_ms, c.queued_ms) == (0.0, 2000.0)


def test_the_worker_counts_its_prefill_and_decode_steps_and_their_batches() -> None:
    """Two requests admitted together: one prefill step, then decode steps of both until the
    shorter ends, then of the longer alone; every step's wall time is counted by its kind."""
    h = Harness()
    h.run([req("a", PREFIX[:20], max_tokens=3), req("b", PREFIX[:30], max_tokens=5)])
    c = h.worker.info().counters
    assert c.num_prefill_steps == 1  # both prompts fit one step
    # a's 2 and b's 4 tokens after their first: 2 steps of both, then 2 of b alone
    assert (c.num_decode_steps, c.num_decode_step_seqs) == (4, 2 * 2 + 2)


def test_the_engine_threads_time_between_steps_reaches_the_counters() -> None:
    tally = WorkerTally()
    tally.on_engine_host(1.5)
    tally.on_engine_host(0.25)
    assert tally.engine_host_ms == 1.75
    assert tally.snapshot(0, 0, WarmSessionStats(0, 0, 0, 0, 0, 0)).engine_host_ms == 1.75


def test_the_tally_adds_each_steps_wall_time_to_its_kind() -> None:
    tally = WorkerTally()
    tally.on_step(True, 2, 30.0)
    tally.on_step(False, 2, 5.0)
    tally.on_step(False, 1, 4.0)
    assert (tally.num_prefill_steps, tally.prefill_steps_ms) == (1, 30.0)
    assert (tally.num_decode_steps, tally.decode_steps_ms, tally.num_decode_step_seqs) == (
        2,
        9.0,
        3,
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_prefill_backlog_kept_between_recounts_equals_a_fresh_recount(seed: int) -> None:
    """A waiting prompt is matched again only when the pool's hashes or its length moved: after
    random arrivals (shared prefixes), steps (registrations, evictions in a small pool) and
    aborts, the kept count equals a recount from nothing."""
    import random

    from kvmesh.workers.engine.prefill_backlog import PrefillBacklog

    rng = random.Random(seed)
    h = Harness(num_blocks=48, max_num_seqs=3)
    w = h.worker
    prefixes = [[(i * (k + 3)) % 250 + 3 for i in range(48)] for k in range(4)]
    live: list[str] = []
    changes = w.pool.num_hash_changes
    for n in range(60):
        op = rng.random()
        if op < 0.45:
            tail = [rng.randrange(3, 250) for _ in range(rng.randrange(20))]
            prompt = rng.choice(prefixes) + tail
            w.add_request(req(f"r{n}", prompt, max_tokens=rng.randrange(1, 6)))
            live.append(f"r{n}")
        elif op < 0.55 and live:
            w.abort(live.pop(rng.randrange(len(live))))
        elif w.has_work:
            h.now_s += 1.0
            w.step()
        fresh = PrefillBacklog(w.pool, w.scheduler, w.pulls, BS)
        fresh.update()
        assert w.backlog.num_tokens == fresh.num_tokens
        w.check_invariants()
    assert w.pool.num_hash_changes > changes  # the blocks registered and evicted moved it
