"""The TTFT trial both GPU transfer benchmarks run: one 8K prompt whose 7.5K prefix is computed
on `source`, then served by `target` (pulling it) and by `source` again (a local hit)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PROMPT, PREFIX = 8192, 7680


def prefix_ttft_trials(
    client: Any, rand: Callable[[int], list[int]], source: str, target: str, trials: int = 3
) -> dict[str, float]:
    """Median TTFT (client-side) of cold / pulled / local-hit requests, and the fewest tokens any
    pulled request reported pulling."""
    samples: dict[str, list[float]] = {"cold_ms": [], "pulled_ms": [], "local_hit_ms": []}
    pulled_tokens = []
    for _ in range(trials):
        prefix = rand(PREFIX)
        cold = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=1, worker_id=source)
        time.sleep(0.2)  # the index learns the source's blocks
        pulled = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=1, worker_id=target)
        local = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=1, worker_id=source)
        samples["cold_ms"].append(cold.ttft_ms or 0.0)
        samples["pulled_ms"].append(pulled.ttft_ms or 0.0)
        samples["local_hit_ms"].append(local.ttft_ms or 0.0)
        pulled_tokens.append(pulled.pulled_tokens)
    out = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    out["pulled_tokens_min"] = float(min(pulled_tokens))
    return out
