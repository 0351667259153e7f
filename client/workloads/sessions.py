"""Open-loop sessions: the turns of chats and agent loops, each quoting the last answer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvmesh.client.workloads.draws import poisson_ms
from kvmesh.client.workloads.request import WorkloadRequest


def open_loop_sessions(
    rng: np.random.Generator,
    num_sessions: int,
    start_rate_rps: float,
    num_turns: int,
    gap_s: float,
    turn: Callable[[int, int, np.ndarray | None], tuple[np.ndarray, np.ndarray, int]],
    prefix: str,
) -> list[WorkloadRequest]:
    """Open-loop sessions: `turn(session, k, previous_prompt)` gives (prompt, answer, output_len),
    and the next turn quotes the answer."""
    starts = poisson_ms(rng, num_sessions, start_rate_rps)
    requests = []
    for s in range(num_sessions):
        t = float(starts[s])
        prompt: np.ndarray | None = None
        for k in range(num_turns):
            prompt, answer, output_len = turn(s, k, prompt)
            requests.append(WorkloadRequest(t, prompt, output_len, f"{prefix}{s}", answer))
            prompt = np.concatenate([prompt, answer])
            t += float(rng.exponential(gap_s * 1000.0))
    requests.sort(key=lambda r: r.arrival_ms)
    return requests
