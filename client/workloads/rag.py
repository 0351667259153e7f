"""The RAG workload: popular documents recurring in front of fresh questions."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import poisson_ms, tokens
from kvmesh.client.workloads.request import WorkloadRequest


@dataclass(frozen=True, slots=True)
class RagConfig:
    """Retrieval-augmented prompts: popular documents recur, so their KV is worth keeping."""

    num_requests: int = 2048
    """Requests in the stream."""
    corpus_docs: int = 1024
    """Documents in the corpus."""
    doc_len: int = 1024
    """Tokens per document."""
    docs_per_request: int = 2
    """Documents retrieved per request, placed first in retrieval order."""
    zipf_alpha: float = 1.1
    """Popularity skew: document of rank r is drawn with probability ~ r^-alpha."""
    question_len: int = 64
    """Tokens of the question after the documents."""
    output_len: int = 128
    """Tokens generated per request."""
    rate_rps: float = 48.0
    """Poisson arrival rate, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))
        if self.docs_per_request > self.corpus_docs:
            raise ValueError(
                f"docs_per_request {self.docs_per_request} > corpus_docs {self.corpus_docs}"
            )


def rag(config: RagConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 3])
    v = config.vocab_size
    docs = [tokens(rng, config.doc_len, v) for _ in range(config.corpus_docs)]
    weights = 1.0 / np.arange(1, config.corpus_docs + 1) ** config.zipf_alpha
    weights /= weights.sum()
    arrivals = poisson_ms(rng, config.num_requests, config.rate_rps)
    requests = []
    for t in arrivals:
        picked = rng.choice(config.corpus_docs, config.docs_per_request, replace=False, p=weights)
        parts = [docs[d] for d in picked] + [tokens(rng, config.question_len, v)]
        requests.append(WorkloadRequest(float(t), np.concatenate(parts), config.output_len))
    return requests
