"""A hit whose cached prefix ends inside a 64-token page, on the GPU: its last cached blocks
copied by the block-copy kernel into the run of its new blocks (`block_runs.relocated_tail`),
so cuDNN reads the chunk in 64-token pages; the same logits as reading the blocks in place. A warm
session's next turn too: its answer's blocks, decoded beside another request's, copied into a
run that the session then keeps."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig
from kvmesh.workers.model import batch_plan
from kvmesh.workers.model.cudnn_pages import cudnn_pages_usable
from kvmesh.workers.model.runner import ModelRunner
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_pages_usable(torch.device("cuda")),
        reason="needs CUDA, a Hopper card and the cuDNN frontend's bindings",
    ),
]

SHARED = [(i * 7) % 250 + 3 for i in range(608)]  # 38 blocks: the prefix ends inside a page


def _worker(
    monkeypatch: pytest.MonkeyPatch, logits: dict[str, list[torch.Tensor]], *, copied: bool
) -> Worker:
    """A bf16 worker over cuDNN's pages keeping every step's logits; `copied`: whether its
    scheduler may copy a cached tail into a run."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 64)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 16)
    config = dataclasses.replace(small_config(), num_layers=3)
    runner = ModelRunner(config, 400, 16, device="cuda", dtype=torch.bfloat16, seed=0)
    runner.attention.mode = dataclasses.replace(
        runner.attention.mode, bucketed_prefill=True, cudnn_pages=True
    )
    worker = Worker(
        "w0",
        runner,
        config.fingerprint(),
        SchedulerConfig(16, 8, 8192),
        logits_sink=lambda rid, row: logits[rid].append(row.float().cpu()),
        clock=lambda: 0.0,
        sessions=WarmSessionConfig(budget_fraction=1.0),
    )
    assert worker.pool.run_blocks == 4
    if not copied:
        worker.scheduler.can_relocate = lambda blocks: False
    return worker


def _drain(worker: Worker) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    while worker.has_work:
        for out in worker.step():
            tokens[out.request_id] += out.new_token_ids
        worker.check_invariants()
    return tokens


def _in_runs(blocks: tuple[int, ...]) -> bool:
    return all(
        list(blocks[j : j + 4]) == list(range(blocks[j], blocks[j] + 4))
        for j in range(0, len(blocks), 4)
    )


def _assert_close(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=0.05 * b.abs().max().item(), rtol=0)
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cosine.item() > 0.999


def serve(monkeypatch: pytest.MonkeyPatch, *, copied: bool) -> tuple[Worker, list[torch.Tensor]]:
    """A cold request, then the hit behind its prefix; the hit's logits of every step."""
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    worker = _worker(monkeypatch, logits, copied=copied)
    for rid, tail in (("cold", [5] * 100), ("hit", [(i * 11) % 250 + 3 for i in range(300)])):
        sampling = SamplingConfig(max_tokens=4, ignore_eos=True)
        worker.add_request(WorkerRequest(rid, tuple(SHARED + tail), sampling))
        while worker.has_work:
            worker.step()
            worker.check_invariants()
    return worker, logits["hit"]


def test_a_copied_tail_is_read_over_runs_with_the_logits_of_reading_it_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copied, copied_logits = serve(monkeypatch, copied=True)
    in_place, in_place_logits = serve(monkeypatch, copied=False)
    # the hit's prefill is the one chunk read from the pages; only the copy makes it a run
    assert copied.runner.page_reads.num_chunks == in_place.runner.page_reads.num_chunks == 1
    assert copied.runner.page_reads.num_run_chunks == 1
    assert in_place.runner.page_reads.num_run_chunks == 0
    assert len(copied_logits) == len(in_place_logits) == 4
    _assert_close(copied_logits, in_place_logits)


def test_a_sessions_next_turn_reads_its_answer_from_copies_in_a_run_the_session_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits: dict[str, dict[str, list[torch.Tensor]]] = {}
    chains: dict[str, tuple[int, ...]] = {}
    workers: dict[str, Worker] = {}
    for mode in ("copied", "in_place"):
        logits[mode] = defaultdict(list)
        worker = workers[mode] = _worker(monkeypatch, logits[mode], copied=mode == "copied")
        sampling = SamplingConfig(max_tokens=40, ignore_eos=True)
        prompt = SHARED + [(i * 11) % 250 + 3 for i in range(100)]
        worker.add_request(WorkerRequest("t0", tuple(prompt), sampling, session_id="s"))
        other = [(i * 13) % 250 + 3 for i in range(300)]  # decoded beside it: the answers'
        worker.add_request(WorkerRequest("o", tuple(other), sampling))  # blocks alternate
        answer = _drain(worker)["t0"]
        turn_1 = prompt + answer + [(i * 5) % 250 + 3 for i in range(300)]
        worker.add_request(WorkerRequest("t1", tuple(turn_1), sampling, session_id="s"))
        _drain(worker)
        chains[mode] = tuple(worker.sessions.chain("s"))
    copied, in_place = workers["copied"], workers["in_place"]
    # turn 1's prefill is the one chunk read from the pages; only the copy makes it a run
    assert copied.runner.page_reads.num_chunks == in_place.runner.page_reads.num_chunks == 1
    assert copied.runner.page_reads.num_run_chunks == 1
    assert in_place.runner.page_reads.num_run_chunks == 0
    assert copied.info().counters.num_relocated_blocks > 0
    _assert_close(logits["copied"]["t1"], logits["in_place"]["t1"])
    # the session keeps the copies: turn 1's prompt lies in runs in its chain
    prompt_blocks = (len(SHARED) + 100 + 40 + 300) // 16
    whole = prompt_blocks - prompt_blocks % 4
    assert _in_runs(chains["copied"][:whole]) and not _in_runs(chains["in_place"][:whole])
