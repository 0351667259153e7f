"""Forward steps recorded as CUDA graphs, one per bucket: what decode and prefill graphs share.

A step runs once eagerly on a side stream first (kernels compile, cuDNN builds its plans, the
allocator settles), then once under capture into the graphs' shared memory pool. Capture is
thread-local: the worker's transfer threads may use CUDA while the engine thread captures.
`StepGraphs` keeps one captured step per bucket: the first step of a bucket captures it, every
later one loads its inputs into the step's static buffers and replays. A capture that fails
(CUDA ends an invalidated capture with an error) leaves its memory pool marked as being recorded
to, so every later capture into it would fail too: the next capture takes a pool of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from kvmesh.workers.model.batch_plan import BatchPlan
from kvmesh.workers.model.graph_counts import GraphCounts

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["StaticStep", "StepGraphs", "capture_step"]


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


class StaticStep(Protocol):
    """One bucket's static inputs (`plan` reads them), its graph and output once captured."""

    plan: BatchPlan
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor | None


B = TypeVar("B", bound=Hashable)
S = TypeVar("S", bound=StaticStep)


class StepGraphs(Generic[B, S]):
    """Captured steps by bucket, all in one memory pool (steps never overlap: they run in
    order on one stream, each replay's output read there before the next replay rewrites it)."""

    def __init__(self, layers: Callable[[BatchPlan], torch.Tensor]) -> None:
        self._layers = layers
        self.steps: dict[B, S] = {}
        self._pool: _POOL_HANDLE | None = None
        self.capture_ms = 0.0
        """Wall time spent capturing buckets, in all (inside the steps that needed them)."""
        self.num_replays = 0
        """Steps served by a graph, since construction."""

    def counts(self) -> GraphCounts:
        return GraphCounts(len(self.steps), self.capture_ms, self.num_replays)

    def forget(self) -> None:
        """Drop every captured step (what they captured no longer holds); buckets capture
        again on their next step."""
        self.steps.clear()

    def replay(self, bucket: B, new_step: Callable[[], S], load: Callable[[S], None]) -> S:
        """Load this step's inputs into its bucket's static step (`new_step` makes and captures
        one the first time) and replay its graph; the step's `hidden` is valid until the next
        call."""
        step = self.steps.get(bucket)
        if step is None:
            began = time.perf_counter()
            step = new_step()
            load(step)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                step.graph, step.hidden = capture_step(self._layers, step.plan, self._pool)
            except BaseException:
                self._pool = None  # this one stays "recording" (module doc)
                raise
            self.steps[bucket] = step
            self.capture_ms += (time.perf_counter() - began) * 1e3
        else:
            load(step)
        assert step.graph is not None
        step.graph.replay()
        self.num_replays += 1
        return step
