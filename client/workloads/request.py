"""One request of a workload: arrival time, prompt, answer length, session."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadRequest:
    """One request of a workload, as a client would send it."""

    arrival_ms: float
    """Arrival time from the start of the workload."""
    token_ids: np.ndarray
    """The prompt, uint32 token ids."""
    output_len: int
    """Tokens to generate."""
    session_id: str = ""
    """Conversation or agent the request belongs to; empty for one-off requests."""
    completion_ids: np.ndarray | None = None
    """The answer a later request quotes (multi-turn, agentic); None when nothing quotes it."""

    def __post_init__(self) -> None:
        if self.arrival_ms < 0:
            raise ValueError(f"arrival_ms must be >= 0, got {self.arrival_ms}")
        if len(self.token_ids) < 1:
            raise ValueError("a request needs at least one prompt token")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)
