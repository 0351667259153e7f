"""What a worker's CUDA graphs of one kind have done: captures, their time, replays (no torch:
the engine's tally reads it)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["NO_GRAPHS", "GraphCounts"]


class GraphCounts(NamedTuple):
    """What a worker's graphs of one kind have done since it started."""

    num_graphs: int
    """Buckets captured (each the first time a step needed it)."""
    capture_ms: float
    """Wall time those captures took, inside the steps that first needed them."""
    num_replays: int
    """Steps served by a replay."""


NO_GRAPHS = GraphCounts(0, 0.0, 0)
"""A runner without graphs of that kind."""
