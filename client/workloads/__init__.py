"""Synthetic workloads: seeded, deterministic request streams shaped like real prefix reuse.

    shared_prefix   G groups x U users; each group shares a system prompt of S tokens, each user
                    asks one question of Q tokens (SGLang's "generated shared prefix" benchmark
                    and llm-d's shared-prefix scenario have this shape); Poisson arrivals
    multi_turn      chat sessions: turn k's prompt is turn k-1's prompt + its answer + a new message
    rag             k documents drawn Zipf-like from a corpus, placed first, then a question
    agentic         agent loops: a long tool-spec prompt, then a context that grows by one tool
                    output and one action per step
    hot_prefix      a few long system prompts of mixed heat (Zipf), the hottest each drawing more
                    than one worker's fair share of the traffic, some one-off prompts, long
                    questions, and short or long answers
    chat_beside_batch  chats with long think times beside a stream of one-off documents that
                    churn the cache while the chats idle (what warm sessions protect against)

Arrivals are open-loop (a turn arrives a think time after the previous turn *arrived*), so the same
stream can be replayed against any policy or cluster. The default sizes and rates load 8 simulated
H100s (64K-token caches each) well past what round-robin can serve, so placement matters; scale
them down (`--workload-arg`) for a CPU cluster. A request carries the answer the workload
expects (`completion_ids`) when a later turn quotes it, so a cache that keeps generated tokens
can be credited for them. The same seed always gives the same requests, token for token.
"""

from __future__ import annotations

from kvmesh.client.workloads.agentic import AgenticConfig, agentic
from kvmesh.client.workloads.chat_beside_batch import ChatBesideBatchConfig, chat_beside_batch
from kvmesh.client.workloads.hot_prefix import HotPrefixConfig, hot_prefix
from kvmesh.client.workloads.multi_turn import MultiTurnConfig, multi_turn
from kvmesh.client.workloads.rag import RagConfig, rag
from kvmesh.client.workloads.registry import (
    WORKLOADS,
    WorkloadSpec,
    generate,
    make_config,
    parse_overrides,
)
from kvmesh.client.workloads.request import WorkloadRequest
from kvmesh.client.workloads.shared_prefix import SharedPrefixConfig, shared_prefix

__all__ = [
    "AgenticConfig",
    "ChatBesideBatchConfig",
    "HotPrefixConfig",
    "MultiTurnConfig",
    "RagConfig",
    "SharedPrefixConfig",
    "WORKLOADS",
    "WorkloadRequest",
    "WorkloadSpec",
    "agentic",
    "chat_beside_batch",
    "generate",
    "hot_prefix",
    "make_config",
    "multi_turn",
    "parse_overrides",
    "rag",
    "shared_prefix",
]
