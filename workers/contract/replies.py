"""What a worker answers: per-step outputs with the prefill's cache facts, its info, its errors.

Plain frozen dataclasses that import neither torch nor Ray. No `-1` sentinels: a field that only
the first output carries is `None` on the others.
"""

from __future__ import annotations

from dataclasses import dataclass


class RequestRejected(ValueError):
    """The worker refused a request it was given (bad input); the message is for the client."""


class WorkerFailed(RuntimeError):
    """The worker failed while running a request (a bug or a device fault), not the client."""


@dataclass(frozen=True, slots=True)
class PrefillFacts:
    """Where a request's prompt KV came from, once its prefill is done.

    prompt:  | local | host | pulled | computed |     local + host + pulled + computed = prompt
    """

    local_tokens: int
    """Reused from this worker's own device pool."""
    host_tokens: int
    """Promoted from this worker's host-memory tier."""
    pulled_tokens: int
    """Fetched from a peer for this request (the pull it was planned with)."""
    computed_tokens: int
    """Prefilled here (the last prompt token always is)."""
    pull_ms: float = 0.0
    """Time the pull took, start to blocks registered (0 without a pull)."""
    pull_bytes: int = 0
    """KV bytes the pull moved."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed: reused from any tier or pulled."""
        return self.local_tokens + self.host_tokens + self.pulled_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.cached_tokens + self.computed_tokens


@dataclass(frozen=True, slots=True)
class SequenceFailure:
    """Why one request was ended by its worker while the others went on; the message is for the
    client (bounded, never the request's own input)."""

    message: str
    internal: bool
    """True for a bug or a fault of the engine (INTERNAL); False when the request's own
    parameters are at fault (INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str = ""
    prefill: PrefillFacts | None = None
    """On the first output of a request only (its prefill is done)."""
    failure: SequenceFailure | None = None
    """Set (with finished=True, finish_reason "error") when this request alone failed."""


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since the worker started."""

    num_requests: int = 0
    num_finished: int = 0
    num_failed: int = 0
    """Requests this worker ended alone (a failure of their own, the others went on)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Reused from the device pool (local hits)."""
    host_hit_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_pulls: int = 0
    num_failed_pulls: int = 0
    num_preemptions: int = 0
    num_host_blocks: int = 0
    num_evicted_blocks: int = 0
    """Registered blocks the device pool reused for new KV (their prefix left the pool)."""
    prefill_ms_per_token: float = 0.0
    """Measured prefill cost (the router's cost model follows it)."""
    num_warm_sessions: int = 0
    """Idle sessions whose chains are kept warm now."""
    warm_session_bytes: int = 0
    """Device KV bytes those chains hold (distinct blocks)."""
    num_sessions_evicted_ttl: int = 0
    """Sessions no longer kept warm because they were idle for the TTL."""
    num_sessions_evicted_budget: int = 0
    """Sessions let go (least recently used first) to stay within the byte budget."""
    num_sessions_evicted_pressure: int = 0
    """Sessions whose whole chain the device pool had to reuse (nothing else was free)."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    pid: int
    node: str
    device: str
    model: str
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    generation: int
    counters: WorkerCounters
    engine_stalled_s: float = 0.0
    """Seconds since the engine loop last went round while it had work (0 when idle): a hung
    engine shows here even though the actor still answers."""
    num_queued_prefill_tokens: int = 0
    """Prompt tokens accepted and not yet prefilled, whichever coordinator sent them: the load
    every coordinator replica sees alike (a waiting prompt counts whole, before cache matching)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the worker serves besides the base model; routers send an adapter's
    requests only to workers that list it."""
