"""The hot-prefix workload: a few system prompts of Zipf heat beside one-off prompts."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import poisson_ms, tokens
from kvmesh.client.workloads.request import WorkloadRequest


@dataclass(frozen=True, slots=True)
class HotPrefixConfig:
    """Hot system prompts: with 8 workers (fair share 12.5%) the defaults give the prompts
    28% / 16% / 12% / 9% / 8% / 7% of the requests and leave 20% without a shared prefix, so
    no placement can keep each prompt on one worker and stay balanced."""

    num_requests: int = 2400
    """Requests in the stream."""
    num_prefixes: int = 6
    """Distinct system prompts."""
    heat_alpha: float = 0.8
    """Heat skew: prompt of rank r is drawn with probability ~ r^-alpha."""
    cold_share: float = 0.2
    """Share of requests with no shared prefix (one-off prompts of the same total length)."""
    prefix_len: int = 4096
    """Tokens of each system prompt."""
    question_len: int = 768
    """Median tokens of the question after it (log-normal, sigma 0.6, at least 16)."""
    short_output_len: int = 24
    """Tokens of a short answer (a classification, a tool call)."""
    long_output_len: int = 640
    """Tokens of a long answer."""
    long_share: float = 0.3
    """Share of requests that get a long answer."""
    rate_rps: float = 40.0
    """Poisson arrival rate, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self) if not f.name.endswith("share")))
        for name in ("cold_share", "long_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def hot_prefix(config: HotPrefixConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 5])
    v = config.vocab_size
    prefixes = [tokens(rng, config.prefix_len, v) for _ in range(config.num_prefixes)]
    heat = 1.0 / np.arange(1, config.num_prefixes + 1) ** config.heat_alpha
    heat /= heat.sum()
    arrivals = poisson_ms(rng, config.num_requests, config.rate_rps)
    requests = []
    for t in arrivals:
        cold = rng.random() < config.cold_share
        if cold:
            head = tokens(rng, config.prefix_len, v)
        else:
            head = prefixes[rng.choice(len(heat), p=heat)]
        question_len = max(16, int(config.question_len * rng.lognormal(0.0, 0.6)))
        long = rng.random() < config.long_share
        output_len = config.long_output_len if long else config.short_output_len
        prompt = np.concatenate([head, tokens(rng, question_len, v)])
        requests.append(WorkloadRequest(float(t), prompt, output_len))
    return requests
