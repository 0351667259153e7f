"""The shared-prefix workload: groups of users behind one system prompt each."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import poisson_ms, tokens
from kvmesh.client.workloads.request import WorkloadRequest


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """Shape of SGLang's generated-shared-prefix benchmark (its defaults: 64 x 16, 2048/128/256)."""

    num_groups: int = 64
    """Distinct system prompts (G)."""
    users_per_group: int = 16
    """Requests per system prompt (U); each asks its own question."""
    system_prompt_len: int = 2048
    """Tokens of each group's shared system prompt (S)."""
    question_len: int = 128
    """Tokens of each user's question (Q)."""
    output_len: int = 256
    """Tokens generated per request (O)."""
    rate_rps: float = 80.0
    """Poisson arrival rate of the requests, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))


def shared_prefix(config: SharedPrefixConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 1])
    v = config.vocab_size
    systems = [tokens(rng, config.system_prompt_len, v) for _ in range(config.num_groups)]
    pairs = [(g, u) for g in range(config.num_groups) for u in range(config.users_per_group)]
    order = rng.permutation(len(pairs))
    arrivals = poisson_ms(rng, len(pairs), config.rate_rps)
    requests = []
    for t, i in zip(arrivals, order, strict=True):
        g, _ = pairs[i]
        prompt = np.concatenate([systems[g], tokens(rng, config.question_len, v)])
        requests.append(WorkloadRequest(float(t), prompt, config.output_len))
    return requests
