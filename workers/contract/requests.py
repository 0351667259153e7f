"""What the coordinator sends a worker: a request, its sampling, and an optional pull plan.

Plain frozen dataclasses that import neither torch nor Ray, so the coordinator's core can build
them without either installed.

A pull plan names blocks by their chain hashes, so the worker can check them against its own
hashing of the prompt before moving anything:

    prompt blocks:   [0 ........ k) [k ............ m) [m ... n)
    held by target:  |   local    |
    held by source:  |         local + pulled          |
    plan:                          hashes of [k, m)     from `source` over `transport`
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.token_ids import TokenIds

MIN_TEMPERATURE = 1e-2
"""Smallest temperature other than 0 (greedy). Below it the scaled logits would only differ from
greedy by rounding; refusing it keeps the documented range one that is numerically safe."""
MAX_TEMPERATURE = 100.0
"""Largest temperature: above it the distribution is uniform to float precision."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """One request's sampling parameters; every combination that constructs is safe to sample."""

    max_tokens: int = 16
    """Tokens to generate (>= 1)."""
    temperature: float = 0.0
    """0 is greedy; otherwise in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    seed: int = 0
    """Seed for temperature > 0 (>= 0)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end the request (besides the model's EOS)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]; 0 disables."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """Why these parameters are invalid, or None. Also asked of a config whose sampling
        failed, to tell the request's own fault (INVALID_ARGUMENT) from a bug (INTERNAL)."""
        t = self.temperature
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not math.isfinite(t) or not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            return (
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}],"
                f" got {t:g}"
            )
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            return f"top_p must be in (0, 1], got {self.top_p:g}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p:g}"
        if self.seed < 0:
            return f"seed must be >= 0, got {self.seed}"
        return None


class Transport(enum.Enum):
    """How a pulled run travels; the coordinator picks it from where the two workers live."""

    OBJECT_STORE = "object_store"
    """One contiguous CPU tensor through Ray's object store (works between any two workers)."""
    CUDA_IPC = "cuda_ipc"
    """Same GPU: copy straight out of the source's pinned blocks, mapped by CUDA IPC."""
    NCCL = "nccl"
    """Different GPUs in one NCCL group: send/recv device to device."""


@dataclass(frozen=True, slots=True)
class PullSpec:
    """Blocks `[from_block, from_block + len(hashes))` of the prompt's chain, to be fetched from
    `source` by the worker that serves the request, while it admits the request."""

    source: str
    """Worker id of the peer holding the longer prefix."""
    from_block: int
    """Index of the first block moved (the blocks before it are the target's own)."""
    hashes: tuple[BlockHash, ...]
    """Chain hashes of the blocks to move, in chain order."""
    transport: Transport = Transport.OBJECT_STORE

    def __post_init__(self) -> None:
        if self.from_block < 0 or not self.hashes:
            raise ValueError(
                f"a pull moves >= 1 block from block >= 0, got {len(self.hashes)} blocks"
                f" from block {self.from_block}"
            )

    @property
    def end_block(self) -> int:
        return self.from_block + len(self.hashes)


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    request_id: str
    prompt_ids: TokenIds | tuple[int, ...]
    """`TokenIds` from a coordinator (it pickles as one buffer); a tuple where a caller builds
    a request by hand. The worker checks either (`workers/engine/request_checks.py`)."""
    sampling: SamplingConfig
    cache_salt: str = ""
    pull: PullSpec | None = None
    """Fetch these blocks from a peer during admission; a failed pull just means recompute."""
    session_id: str = ""
    """Conversation the request is a turn of (empty: none). The worker keeps the session's chain
    warm after the turn (`workers/kv/warm_sessions.py`); a migrated turn keeps it."""
    adapter: str = ""
    """LoRA adapter to run the request with (empty: the base model); part of its namespace, so
    its blocks are never shared with the base model's or another adapter's."""
    bypass_cache: bool = False
    """Reuse no cached KV (local, host or pulled) and register none of what it computes."""
    origin: str = ""
    """Id of the coordinator that routed it; the worker's request notes carry it back, so that
    replica skips its own (`proto/request_notes.py`)."""
    reply_to: str = ""
    """The worker's output stream its outputs go out on (`WorkerActor.outputs`: one per
    coordinator and worker); set by the coordinator's Ray shell when it submits the request."""
    sent_at_s: float = 0.0
    """Wall-clock time (`time.time()`) the coordinator made it, after routing; the worker reports
    how long it took to reach it (`PrefillFacts.dispatch_ms`). 0: not stamped."""
