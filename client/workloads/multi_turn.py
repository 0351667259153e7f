"""The multi-turn workload: chat sessions whose every turn quotes the one before."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import tokens
from kvmesh.client.workloads.request import WorkloadRequest
from kvmesh.client.workloads.sessions import open_loop_sessions


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """Chat sessions that start as a Poisson process and each run a fixed number of turns."""

    num_sessions: int = 1024
    """Conversations."""
    turns_per_session: int = 6
    """Turns of each conversation."""
    system_prompt_len: int = 512
    """One system prompt shared by every conversation."""
    first_message_len: int = 1024
    """Tokens of a conversation's opening message (pasted context, instructions)."""
    user_message_len: int = 96
    """Tokens of each later user message."""
    answer_len: int = 192
    """Tokens of each answer; the next turn quotes it."""
    think_time_s: float = 20.0
    """Mean time between a turn's arrival and the next one's (exponential)."""
    session_rate_rps: float = 8.0
    """Poisson rate at which conversations start, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))


def multi_turn(config: MultiTurnConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 2])
    v = config.vocab_size
    system = tokens(rng, config.system_prompt_len, v)

    def turn(s: int, k: int, history: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        if history is None:
            prompt = np.concatenate([system, tokens(rng, config.first_message_len, v)])
        else:
            prompt = np.concatenate([history, tokens(rng, config.user_message_len, v)])
        return prompt, tokens(rng, config.answer_len, v), config.answer_len

    return open_loop_sessions(
        rng,
        config.num_sessions,
        config.session_rate_rps,
        config.turns_per_session,
        config.think_time_s,
        turn,
        "chat",
    )
