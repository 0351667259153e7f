"""What a worker answers: per-step outputs with the prefill's cache facts, its info, its errors.

Plain frozen dataclasses that import neither torch nor Ray. No `-1` sentinels: a field that only
the first output carries is `None` on the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


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
    pull_source_ms: float = 0.0
    """Of `pull_ms`: until the source answered (pinned its run, agreed to send, or exported)."""
    pull_write_ms: float = 0.0
    """Of `pull_ms`: the engine call that wrote the blocks (or enqueued their copy) and
    registered them; the rest is waiting (for the reservation, for the engine thread)."""
    pull_bytes: int = 0
    """KV bytes the pull moved."""
    dispatch_ms: float = 0.0
    """From the coordinator sending the request (`WorkerRequest.sent_at_s`) to this worker
    accepting it, by the two hosts' wall clocks (0: not stamped)."""
    queued_ms: float = 0.0
    """From the worker accepting the request to the first step that ran part of its prompt
    (the step in progress when it came, and the pull, included): with `prefill_ms`, where the
    worker's share of the TTFT went."""
    prefill_ms: float = 0.0
    """From that first step to the first token (its chunks, and the steps between them)."""

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

    @property
    def joinable(self) -> bool:
        """Whether a later output of the request may join this one (`then`): not finished and
        not a failure."""
        return not self.finished and self.failure is None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the request's next one as one (the caller had not taken this one
        yet): the tokens in order, the later one's end, the first one's prefill facts. Neither
        may be a failure, and this one may not be finished."""
        if later.request_id != self.request_id or not self.joinable or later.failure:
            raise ValueError(
                f"cannot join outputs {self.request_id!r} (finished={self.finished}, "
                f"failed={self.failure is not None}) and {later.request_id!r} "
                f"(failed={later.failure is not None})"
            )
        return RequestOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            later.finished,
            later.finish_reason,
            self.prefill if self.prefill is not None else later.prefill,
        )


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
    num_pulls_in_admission: int = 0
    """Same-GPU pulls run inside their request's admission on the engine thread (the rest of
    `num_pulls` went through the worker's event loop)."""
    num_preemptions: int = 0
    num_host_blocks: int = 0
    num_evicted_blocks: int = 0
    """Registered blocks the device pool reused for new KV (their prefix left the pool)."""
    num_lookup_hits: int = 0
    """Requests whose first prefill reused a cached block (see `CacheStats`)."""
    num_lookup_misses: int = 0
    num_host_evicted_blocks: int = 0
    prefill_ms_per_token: float = 0.0
    """Measured prefill cost (the router's cost model follows it)."""
    num_prefill_steps: int = 0
    """Engine steps that prefilled (one or more requests' prompts, no decodes)."""
    prefill_steps_ms: float = 0.0
    """Their wall time in all, host work included (scheduling, the forward, the outputs)."""
    num_decode_steps: int = 0
    """Engine steps that decoded a batch (a token for each running sequence)."""
    decode_steps_ms: float = 0.0
    """Their wall time in all, host work included."""
    num_decode_step_seqs: int = 0
    """Sequences over all decode steps (divided by `num_decode_steps`: the mean batch)."""
    engine_host_ms: float = 0.0
    """The engine thread's time between its steps, in all: taking requests in, delivering
    outputs, publishing KV events, heartbeats (not the steps, not idle waits)."""
    num_decode_graphs: int = 0
    """Decode step shapes captured as CUDA graphs so far (each the first time a step needed it)."""
    decode_graph_capture_ms: float = 0.0
    """Wall time those captures took, in all: inside the decode steps that first needed them."""
    num_decode_graph_replays: int = 0
    """Decode steps replayed from those graphs."""
    num_prefill_graphs: int = 0
    """Long-chunk prefill shapes (cache hits read by cuDNN from the pages) captured as CUDA
    graphs so far."""
    prefill_graph_capture_ms: float = 0.0
    """Wall time those captures took, in all: inside the prefill steps that first needed them."""
    num_prefill_graph_replays: int = 0
    """Prefill steps replayed from those graphs."""
    num_host_layer_loads: int = 0
    """Host-tier promotions run layer by layer beside the prefill (the start-up warm-up's one or
    two included)."""
    num_host_copy_engine_loads: int = 0
    """Of those, the ones the GPU's copy engines moved (the host slots came in runs); the rest
    the load kernel did."""
    num_queued_decode_steps: int = 0
    """Decode steps queued on the device before the host had read the step before them
    (`decode_pipeline`)."""
    num_dropped_decode_rows: int = 0
    """Rows those steps computed for sequences that had ended meanwhile (a stop token, an
    abort), dropped."""
    num_page_chunks: int = 0
    """Prefill chunks cuDNN read straight from the paged cache (`cudnn_pages`)."""
    num_run_page_chunks: int = 0
    """Of those, the ones read as pages of several blocks (the chunk's blocks lay in
    runs, `cudnn_pages.blocks_per_page`); the rest one block a page."""
    num_relocated_blocks: int = 0
    """Cached blocks copied into the run of a prompt's new blocks at its admission, so that
    its chunk reads in such pages (`block_runs.relocated_tail`)."""
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
class CacheStats:
    """One worker's prefix cache (or a cluster's: `CacheStats.total`). Token counts are per
    request's first prefill, so `saved_prefill_tokens == local + host + pulled hit tokens`."""

    enabled: bool = True
    """Prefix caching on (`--no-prefix-cache` turns it off: nothing is reused or registered)."""
    block_size: int = 0
    kv_dtype: str = ""
    """Dtype of the KV blocks (part of every root hash); a cluster of several: comma-joined."""
    cache_epoch: int = 0
    """Bumped by ClearCache; a cluster: the highest of its workers'."""
    num_lookup_hits: int = 0
    """Requests whose prompt reused at least one cached block (any tier, or pulled)."""
    num_lookup_misses: int = 0
    """Requests that looked and reused nothing (requests with `bypass_cache` do not look)."""
    local_hit_tokens: int = 0
    """Prompt tokens reused from the device pool."""
    host_hit_tokens: int = 0
    """Prompt tokens promoted from the host tier."""
    pulled_hit_tokens: int = 0
    """Prompt tokens fetched from a peer."""
    saved_prefill_tokens: int = 0
    """Prompt tokens not prefilled thanks to the cache: local + host + pulled."""
    num_device_evictions: int = 0
    """Registered device blocks reused for new KV (their hash dropped)."""
    num_host_evictions: int = 0
    """Host-tier blocks dropped to make room."""
    num_preemptions: int = 0
    num_device_entries: int = 0
    """Registered (matchable) blocks in the device pool."""
    num_host_entries: int = 0
    num_bytes: int = 0
    """KV bytes those entries hold (device + host)."""

    @property
    def num_entries(self) -> int:
        return self.num_device_entries + self.num_host_entries

    @staticmethod
    def total(parts: Iterable[CacheStats]) -> CacheStats:
        """The cluster's figures: every count summed, so they add up to the workers' own."""
        parts = list(parts)
        sums = {
            f.name: sum(getattr(p, f.name) for p in parts)
            for f in fields(CacheStats)
            if f.name.startswith("num_") or f.name.endswith("_tokens")
        }
        return CacheStats(
            enabled=bool(parts) and all(p.enabled for p in parts),
            block_size=max((p.block_size for p in parts), default=0),
            kv_dtype=",".join(sorted({p.kv_dtype for p in parts if p.kv_dtype})),
            cache_epoch=max((p.cache_epoch for p in parts), default=0),
            **sums,
        )


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
    cache: CacheStats = CacheStats()
    """The worker's prefix-cache figures (`kvmesh stats`, ListWorkers)."""
