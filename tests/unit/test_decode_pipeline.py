"""Decode steps queued one ahead of the host (`decode_pipeline`): the same tokens as the engine
that reads every step before the next, no block lost or reused while a queued step writes it."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner

BS = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights() -> ModelRunner:
    return ModelRunner(preset("tiny-random"), 8, BS, seed=0)


def worker(weights: ModelRunner, *, pipelined: bool, num_blocks: int = 96) -> Worker:
    config = weights.config
    runner = ModelRunner(config, num_blocks, BS, weights=weights.weights)
    return Worker(
        "w0",
        runner,
        config.fingerprint(),
        SchedulerConfig(BS, 8, 4096),
        pipelined_decode=pipelined,
    )


def prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 300) for _ in range(length))


def req(rid: str, which: int, **sampling: object) -> WorkerRequest:
    config = SamplingConfig(**{"max_tokens": 12, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return WorkerRequest(rid, prompt(which, 20 + 7 * which), config)


def serve(
    w: Worker, requests: list[WorkerRequest], later: dict[int, WorkerRequest] | None = None
) -> dict[str, list[int]]:
    """Every request's tokens; `later`: requests added after that many steps."""
    for r in requests:
        w.add_request(r)
    later = dict(later or {})
    out: dict[str, list[int]] = defaultdict(list)
    finished: set[str] = set()
    num_steps = 0
    while w.has_work or later:
        if num_steps in later:
            w.add_request(later.pop(num_steps))
        for o in w.step():
            assert o.request_id not in finished, "an output after the last"
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
        num_steps += 1
        w.check_invariants()
    assert finished == set(out)
    assert w.pool.num_free == w.pool.num_blocks  # nothing held once all is done
    return dict(out)


def test_queued_steps_give_the_tokens_of_the_engine_that_reads_each_step(
    weights: ModelRunner,
) -> None:
    requests = [req(f"r{i}", i, max_tokens=4 + 3 * i) for i in range(5)]
    pipelined = worker(weights, pipelined=True)
    got = serve(pipelined, requests)
    assert got == serve(worker(weights, pipelined=False), requests)
    assert [len(got[f"r{i}"]) for i in range(5)] == [4 + 3 * i for i in range(5)]
    counters = pipelined.info().counters
    assert counters.num_queued_decode_steps >= 10
    assert counters.num_dropped_decode_rows == 0  # lengths are known ahead: nobody rides along


def test_a_sequence_that_stops_on_a_token_rides_one_step_and_is_dropped(
    weights: ModelRunner,
) -> None:
    free_running = serve(worker(weights, pipelined=False), [req("a", 1), req("b", 2)])
    stop = free_running["a"][4]  # "a" ends at its fifth token (or sooner, where it recurs)
    requests = [req("a", 1, stop_token_ids=(stop,)), req("b", 2)]
    pipelined = worker(weights, pipelined=True)
    got = serve(pipelined, requests)
    assert got == serve(worker(weights, pipelined=False), requests)
    assert got["a"][-1] == stop and len(got["a"]) <= 5
    assert pipelined.decode_pipeline is not None
    assert pipelined.decode_pipeline.num_dropped_rows == 1


def test_an_abort_while_a_step_is_queued_frees_its_blocks_only_after_it_lands(
    weights: ModelRunner,
) -> None:
    w = worker(weights, pipelined=True)
    for r in (req("a", 1, max_tokens=30), req("b", 2, max_tokens=30)):
        w.add_request(r)
    for _ in range(4):  # the prefill, then decode steps: one is queued now
        w.step()
    pipeline = w.decode_pipeline
    assert pipeline is not None and pipeline.queued is not None
    seq_a = next(s for s in pipeline.queued.step.seqs if s.request_id == "a")
    written = seq_a.block_table[-1]
    assert w.abort("a")
    w.check_invariants()
    assert w.pool.ref_count(written) == 1  # the queued step's own reference
    outputs = w.step()
    assert [o.request_id for o in outputs] == ["b"]  # a's row was dropped
    assert pipeline.num_dropped_rows == 1
    assert all(o.request_id != "a" for _ in range(40) for o in w.step())
    w.check_invariants()
    assert w.pool.num_free == w.pool.num_blocks


def test_a_request_arriving_mid_decode_is_admitted_and_the_tokens_match(
    weights: ModelRunner,
) -> None:
    first = [req("a", 1, max_tokens=20), req("b", 2, max_tokens=20)]
    later = {6: req("c", 3, max_tokens=10)}
    pipelined = serve(worker(weights, pipelined=True), first, later)
    assert pipelined == serve(worker(weights, pipelined=False), first, later)
    assert len(pipelined["c"]) == 10


def test_sampled_sequences_are_queued_and_draw_the_engines_tokens(weights: ModelRunner) -> None:
    requests = [
        req("a", 1),
        req("b", 2, temperature=0.8, seed=3),
        req("c", 3, temperature=1.3, seed=3, top_k=20, max_tokens=9),
        req("d", 4, temperature=0.7, top_p=0.9, min_p=0.05, seed=11, max_tokens=15),
    ]
    pipelined = worker(weights, pipelined=True)
    got = serve(pipelined, requests)
    assert got == serve(worker(weights, pipelined=False), requests)
    assert got["b"] != serve(worker(weights, pipelined=False), [req("b", 2)])["b"]  # drawn
    assert pipelined.decode_pipeline is not None
    assert pipelined.decode_pipeline.num_queued_steps >= 8


class _NanAt(ModelRunner):
    """The real runner, except that a chunk starting at `position` gets NaN logits."""

    position = -1

    def _forward(self, batch, token_ids=None):  # type: ignore[no-untyped-def]
        logits = super()._forward(batch, token_ids)
        rows = [i for i, c in enumerate(batch) if c.start_pos == self.position]
        return logits.index_fill(0, torch.tensor(rows, dtype=torch.int64), float("nan"))


def test_a_queued_row_that_cannot_be_drawn_fails_its_request_alone(
    weights: ModelRunner,
) -> None:
    """NaN logits in a sampled row of a queued step: that request fails as the engine that reads
    each step fails it, the others get their tokens, nothing is held."""
    requests = [
        req("a", 1, temperature=0.9, seed=5),  # a 27-token prompt: its decode starts at 27
        req("b", 2, temperature=0.9, seed=6),
        req("c", 3),
    ]
    results = {}
    for pipelined in (True, False):
        config = weights.config
        runner = _NanAt(config, 96, BS, weights=weights.weights)
        runner.position = 27 + 3
        w = Worker("w0", runner, config.fingerprint(), SchedulerConfig(BS, 8, 4096),
                   pipelined_decode=pipelined)  # fmt: skip
        for r in requests:
            w.add_request(r)
        outs: dict[str, list[object]] = defaultdict(list)
        while w.has_work:
            for o in w.step():
                outs[o.request_id].append(o)
            w.check_invariants()
        assert w.pool.num_free == w.pool.num_blocks
        results[pipelined] = outs
        if pipelined:
            assert w.decode_pipeline is not None and w.decode_pipeline.num_queued_steps > 0
    for outs in results.values():
        last = outs["a"][-1]
        assert last.finished and last.finish_reason == "error"  # type: ignore[attr-defined]
        assert last.failure is not None and last.failure.internal  # type: ignore[attr-defined]
    tokens = {
        p: {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in outs}  # type: ignore[attr-defined]
        for p, outs in results.items()
    }
    assert tokens[True] == tokens[False]
    assert len(tokens[True]["a"]) == 4 and len(tokens[True]["b"]) == 12  # a: prefill + 3 steps


def test_a_pool_too_small_to_go_on_falls_back_to_the_scheduler(weights: ModelRunner) -> None:
    # 6 blocks of 16: three sequences outgrow it, so steps end in preemption and recompute.
    requests = [req(f"r{i}", i, max_tokens=40) for i in range(3)]
    pipelined = worker(weights, pipelined=True, num_blocks=12)
    got = serve(pipelined, requests)
    assert got == serve(worker(weights, pipelined=False, num_blocks=12), requests)
    assert pipelined.scheduler.num_preemptions > 0
    assert all(len(got[f"r{i}"]) == 40 for i in range(3))


def test_fed_tokens_of_a_shrinking_batch_follow_their_rows(weights: ModelRunner) -> None:
    # Lengths 3, 9, 5, 7: rows leave the batch from the middle while steps are queued.
    requests = [req(f"r{i}", i, max_tokens=n) for i, n in enumerate((3, 9, 5, 7))]
    got = serve(worker(weights, pipelined=True), requests)
    want = {
        r.request_id: serve(worker(weights, pipelined=False), [r])[r.request_id] for r in requests
    }
    assert got == want


def test_step_tokens_rows_keep_their_order() -> None:
    from kvmesh.workers.model.step_tokens import StepTokens

    tokens = StepTokens.of_logits(torch.eye(5)[[3, 0, 4, 1]])
    assert tokens.tolist() == [3, 0, 4, 1]
    assert tokens.rows([2, 0]).tolist() == [4, 3]
    assert tokens.rows(range(4)) is tokens
    assert tokens.failed_rows() == []
    drawn = StepTokens.of_pick(torch.tensor([7, 8, 9]), torch.tensor([False, True, False]))
    assert drawn.tolist() == [7, 8, 9] and drawn.failed_rows() == [1]
    assert drawn.rows([1, 2]).failed_rows() == [0] and drawn.rows([2, 0]).failed_rows() == []


class _Unreadable:
    """Tokens whose read fails (a device error surfacing at the copy)."""

    def tolist(self) -> list[int]:
        raise RuntimeError("device lost")


def test_a_step_whose_tokens_cannot_be_read_gives_its_blocks_back(weights: ModelRunner) -> None:
    w = worker(weights, pipelined=True)
    for r in (req("a", 1, max_tokens=30), req("b", 2, max_tokens=30)):
        w.add_request(r)
    for _ in range(3):
        w.step()
    pipeline = w.decode_pipeline
    assert pipeline is not None and pipeline.queued is not None
    pipeline.queued = replace(pipeline.queued, tokens=_Unreadable())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="device lost"):
        w.step()
    assert pipeline.landing is None
    for rid in ("a", "b"):  # what the actor does when a step fails: fail the requests
        w.abort(rid)
    while w.has_work:  # the step queued behind the failed one lands and is dropped
        assert w.step() == []
    w.check_invariants()
    assert w.pool.num_free == w.pool.num_blocks
