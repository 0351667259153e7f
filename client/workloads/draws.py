"""The random draws every workload is made of: token runs and Poisson arrival times."""

from __future__ import annotations

import numpy as np


def tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    """`n` token ids drawn uniformly from [0, vocab_size), uint32."""
    return rng.integers(0, vocab_size, n, dtype=np.uint32)


def poisson_ms(rng: np.random.Generator, n: int, rate_rps: float) -> np.ndarray:
    """Arrival times (ms) of `n` requests of a Poisson process of `rate_rps` per second."""
    return np.cumsum(rng.exponential(1000.0 / rate_rps, n))
