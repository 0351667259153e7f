"""Captured steps (`step_capture`): a capture that fails does not make every later one fail."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvmesh.workers.model.batch_plan import BatchPlan
from kvmesh.workers.model.step_capture import StepGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@dataclass
class _Step:
    plan: BatchPlan
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None


def _plan(x: torch.Tensor) -> BatchPlan:
    return BatchPlan(
        token_ids=x,
        positions=x,
        write_slots=x,
        last_rows=x,
        chunk_lens=[x.numel()],
        fresh=[],
        cached=[],
        decode=None,
        paged=[],
    )


def test_a_failed_capture_leaves_the_next_bucket_a_pool_that_captures() -> None:
    x = torch.arange(8, device="cuda", dtype=torch.int64)
    capturing = {"fail": False}

    def layers(plan: BatchPlan) -> torch.Tensor:
        out = plan.token_ids * 2
        if capturing["fail"] and torch.cuda.is_current_stream_capturing():
            out.sum().item()  # a host read: CUDA invalidates the capture
        return out

    graphs: StepGraphs[int, _Step] = StepGraphs(layers)
    capturing["fail"] = True
    with pytest.raises(RuntimeError):
        graphs.replay(0, lambda: _Step(_plan(x)), lambda step: None)
    torch.cuda.synchronize()
    capturing["fail"] = False
    step = graphs.replay(1, lambda: _Step(_plan(x)), lambda step: None)
    assert step.hidden is not None and step.hidden.tolist() == [2 * i for i in range(8)]
    x.add_(1)  # a replay reads the static input again
    step = graphs.replay(1, lambda: _Step(_plan(x)), lambda step: None)
    torch.cuda.synchronize()
    assert step.hidden is not None and step.hidden.tolist() == [2 * (i + 1) for i in range(8)]
    assert graphs.counts().num_graphs == 1 and graphs.counts().num_replays == 2
