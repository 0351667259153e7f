"""The chat-beside-batch workload: idle chats while one-off documents churn the cache."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import poisson_ms, tokens
from kvmesh.client.workloads.multi_turn import MultiTurnConfig, multi_turn
from kvmesh.client.workloads.request import WorkloadRequest


@dataclass(frozen=True, slots=True)
class ChatBesideBatchConfig:
    """Chat sessions with long think times beside a stream of one-off documents (summaries,
    extraction) that nobody sends twice: the documents churn the cache while the chats idle."""

    num_sessions: int = 256
    """Conversations."""
    turns_per_session: int = 6
    """Turns of each conversation."""
    system_prompt_len: int = 512
    """One system prompt shared by every conversation."""
    first_message_len: int = 1024
    """Tokens of a conversation's opening message."""
    user_message_len: int = 96
    """Tokens of each later user message."""
    answer_len: int = 192
    """Tokens of each answer; the next turn quotes it."""
    think_time_s: float = 30.0
    """Mean time between a turn's arrival and the next one's (exponential)."""
    session_rate_rps: float = 2.0
    """Poisson rate at which conversations start, per second."""
    num_documents: int = 2048
    """One-off requests, each a fresh document."""
    document_len: int = 2048
    """Tokens of each document."""
    document_output_len: int = 64
    """Tokens generated per document."""
    document_rate_rps: float = 8.0
    """Poisson rate of the documents, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))


def chat_beside_batch(config: ChatBesideBatchConfig, seed: int) -> list[WorkloadRequest]:
    chats = multi_turn(
        MultiTurnConfig(
            num_sessions=config.num_sessions,
            turns_per_session=config.turns_per_session,
            system_prompt_len=config.system_prompt_len,
            first_message_len=config.first_message_len,
            user_message_len=config.user_message_len,
            answer_len=config.answer_len,
            think_time_s=config.think_time_s,
            session_rate_rps=config.session_rate_rps,
            vocab_size=config.vocab_size,
        ),
        seed,
    )
    rng = np.random.default_rng([seed, 6])
    arrivals = poisson_ms(rng, config.num_documents, config.document_rate_rps)
    documents = [
        WorkloadRequest(
            float(t),
            tokens(rng, config.document_len, config.vocab_size),
            config.document_output_len,
        )
        for t in arrivals
    ]
    return sorted(chats + documents, key=lambda r: r.arrival_ms)
