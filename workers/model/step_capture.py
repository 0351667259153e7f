"""Recording one forward step as a CUDA graph: what decode and prefill graphs share.

The step runs once eagerly on a side stream first (kernels compile, cuDNN builds its plans, the
allocator settles), then once under capture into the graphs' shared memory pool. Capture is
thread-local: the worker's transfer threads may use CUDA while the engine thread captures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvmesh.workers.model.batch_plan import BatchPlan

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["capture_step"]


def capture_step(
    layers: Callable[[BatchPlan], torch.Tensor], plan: BatchPlan, pool: _POOL_HANDLE
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The graph of `layers(plan)` and its output tensor (rewritten by every replay)."""
    device = plan.token_ids.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        layers(plan)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        hidden = layers(plan)
    return graph, hidden
