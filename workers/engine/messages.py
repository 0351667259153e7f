"""What goes into and comes out of a worker: requests, per-step outputs, counters, info."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.workers.engine.failure import SequenceFailure
from kvmesh.workers.engine.sampler import SamplingConfig


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str = ""
    # Set on the first output of a request (when its prefill is done).
    cached_tokens: int = -1
    computed_tokens: int = -1
    # Set (with finished=True, finish_reason "error") when this request alone failed.
    failure: SequenceFailure | None = None


@dataclass(slots=True)
class WorkerCounters:
    num_requests: int = 0
    num_finished: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    host_hit_tokens: int = 0
    pulled_blocks: int = 0
    prefill_ms_total: float = 0.0
    prefill_tokens_total: int = 0


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
    counters: dict[str, float] = field(default_factory=dict)
