"""What one policy achieved in a simulation: the contract's metrics, and the samples behind them.

Latency is reported three ways, as serving users feel it: TTFT (arrival to first token, queueing
included), TPOT (time per output token after the first: (last - first) / (output_len - 1), so
every decode step a request waited through counts, chunk steps included) and end-to-end latency
(arrival to last token). Goodput counts only the requests that met the SLO on both TTFT and TPOT
(a one-token request has no TPOT and meets it), per second of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The keys `kvmesh simulate --json` promises per policy, in print order.
METRIC_KEYS = (
    "hit_rate",
    "pulled_rate",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "e2e_p50_ms",
    "e2e_p90_ms",
    "e2e_p99_ms",
    "throughput_rps",
    "goodput_rps",
    "slo_attainment",
    "imbalance",
    "decisions_per_s",
)


@dataclass(frozen=True, slots=True)
class Slo:
    """The service-level objective a request must meet to count towards goodput."""

    ttft_ms: float = 2000.0
    """Longest acceptable time to first token."""
    tpot_ms: float = 100.0
    """Longest acceptable mean time per output token after the first."""

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(
                f"SLO bounds must be > 0, got TTFT {self.ttft_ms} ms, TPOT {self.tpot_ms} ms"
            )

    def met(self, ttft_ms: np.ndarray, tpot_ms: np.ndarray) -> np.ndarray:
        """Per request: both bounds held (a NaN TPOT, one output token, holds)."""
        tpot_ok = np.isnan(tpot_ms) | (tpot_ms <= self.tpot_ms)
        return (ttft_ms <= self.ttft_ms) & tpot_ok


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy's run over one workload."""

    policy: str
    num_requests: int
    """Requests completed (every request of the workload)."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV the serving worker already held."""
    pulled_tokens: int
    """Prompt tokens fetched from a peer before the prefill."""
    hit_rate: float
    """cached_tokens / prompt_tokens (local reuse; pulls are counted apart)."""
    pulled_rate: float
    """pulled_tokens / prompt_tokens."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    """Completed requests per second, from the first arrival to the last completion."""
    goodput_rps: float
    """Requests that met the SLO, per second of the same span."""
    slo_attainment: float
    """Share of requests that met the SLO."""
    imbalance: float
    """max / mean of the workers' busy time (1.0 is perfectly even)."""
    decisions_per_s: float
    """Routing decisions per second of CPU (index lookup + views + policy), one process."""
    busy_ms: tuple[float, ...]
    """Per worker, simulated time spent prefilling or decoding."""
    requests_per_worker: tuple[int, ...]
    ttft_ms: tuple[float, ...]
    """Every request's time to first token, in workload order (for CDFs)."""
    tpot_ms: tuple[float, ...]
    """Every request's time per output token (NaN for one-token requests)."""
    e2e_ms: tuple[float, ...]
    """Every request's arrival-to-last-token latency."""
    wall_s: float
    """Real time the simulation of this policy took."""
    commit_attempts_per_request: float = 0.0
    """Decision-log commits per request, lost ones included (0: no log)."""
    commit_ms_mean: float = 0.0
    """Mean time the commits held a request back from its worker (attempts x the round trip;
    with speculative dispatch, the trips before its last redirect)."""
    redirects_per_request: float = 0.0
    """Speculatively sent requests moved to another worker after a lost commit, per request."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate}")
        if self.num_requests != len(self.ttft_ms):
            raise ValueError(f"{self.num_requests} requests but {len(self.ttft_ms)} TTFT samples")

    def metrics(self) -> dict[str, float]:
        """The contract's metrics (`METRIC_KEYS`)."""
        return {k: float(getattr(self, k)) for k in METRIC_KEYS}


def summarize(
    policy: str,
    prompt_lens: Sequence[int],
    cached_tokens: Sequence[int],
    pulled_tokens: Sequence[int],
    ttft_ms: Sequence[float],
    tpot_ms: Sequence[float],
    e2e_ms: Sequence[float],
    slo: Slo,
    first_arrival_ms: float,
    last_finish_ms: float,
    busy_ms: Sequence[float],
    requests_per_worker: Sequence[int],
    decision_s: float,
    wall_s: float,
) -> PolicyResult:
    """Fold per-request samples into a `PolicyResult`."""
    n = len(ttft_ms)
    if n == 0:
        raise ValueError("cannot summarize a run without requests")
    prompt, cached, pulled = int(sum(prompt_lens)), int(sum(cached_tokens)), int(sum(pulled_tokens))
    ttft, tpot, e2e = (np.asarray(x, dtype=float) for x in (ttft_ms, tpot_ms, e2e_ms))
    p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99]))
    decoded = tpot[~np.isnan(tpot)]
    tpot_p50, tpot_p90 = (
        (float(x) for x in np.percentile(decoded, [50, 90])) if len(decoded) else (0.0, 0.0)
    )
    e2e_p50, e2e_p90, e2e_p99 = (float(x) for x in np.percentile(e2e, [50, 90, 99]))
    num_good = int(slo.met(ttft, tpot).sum())
    span_s = max(last_finish_ms - first_arrival_ms, 1e-9) / 1000.0
    mean_busy = sum(busy_ms) / len(busy_ms)
    return PolicyResult(
        policy=policy,
        num_requests=n,
        prompt_tokens=prompt,
        cached_tokens=cached,
        pulled_tokens=pulled,
        hit_rate=cached / prompt,
        pulled_rate=pulled / prompt,
        ttft_p50_ms=p50,
        ttft_p90_ms=p90,
        ttft_p99_ms=p99,
        tpot_p50_ms=tpot_p50,
        tpot_p90_ms=tpot_p90,
        e2e_p50_ms=e2e_p50,
        e2e_p90_ms=e2e_p90,
        e2e_p99_ms=e2e_p99,
        throughput_rps=n / span_s,
        goodput_rps=num_good / span_s,
        slo_attainment=num_good / n,
        imbalance=max(busy_ms) / mean_busy if mean_busy > 0 else 1.0,
        decisions_per_s=n / max(decision_s, 1e-9),
        busy_ms=tuple(float(b) for b in busy_ms),
        requests_per_worker=tuple(requests_per_worker),
        ttft_ms=tuple(float(t) for t in ttft),
        tpot_ms=tuple(float(t) for t in tpot),
        e2e_ms=tuple(float(t) for t in e2e),
        wall_s=wall_s,
    )
