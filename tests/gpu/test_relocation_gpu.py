"""A hit whose cached prefix ends inside a 64-token page, on the GPU: its last cached blocks
copied by the block-copy kernel into the run of its new blocks (`block_runs.relocated_tail`),
so cuDNN reads the chunk in 64-token pages; the same logits as reading the blocks in place."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
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


def serve(monkeypatch: pytest.MonkeyPatch, *, copied: bool) -> tuple[Worker, list[torch.Tensor]]:
    """A bf16 worker over cuDNN's pages: a cold request, then the hit behind its prefix; the
    hit's logits of every step."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 64)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 16)
    config = dataclasses.replace(small_config(), num_layers=3)
    runner = ModelRunner(config, 400, 16, device="cuda", dtype=torch.bfloat16, seed=0)
    runner.attention.mode = dataclasses.replace(
        runner.attention.mode, bucketed_prefill=True, cudnn_pages=True
    )
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    worker = Worker(
        "w0",
        runner,
        config.fingerprint(),
        SchedulerConfig(16, 8, 8192),
        logits_sink=lambda rid, row: logits[rid].append(row.float().cpu()),
        clock=lambda: 0.0,
    )
    assert worker.pool.run_blocks == 4
    if not copied:
        worker.scheduler.can_relocate = lambda blocks: False
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
    for mine, theirs in zip(copied_logits, in_place_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=0.05 * theirs.abs().max().item(), rtol=0)
        cosine = torch.nn.functional.cosine_similarity(mine.flatten(), theirs.flatten(), dim=0)
        assert cosine.item() > 0.999
