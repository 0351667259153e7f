"""What the client hands back: plain frozen dataclasses, never protobuf messages.

Field names follow the wire contract (proto/kvmesh.proto) so a value read here means the same as
the one the server sent. Token counts are in tokens, times in milliseconds (`*_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheFacts:
    """Where a request ran and how much of its prompt's KV was reused, pulled or computed."""

    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV was already in the worker's pool."""
    pulled_tokens: int
    """Prompt tokens whose KV was fetched from a peer worker."""
    computed_tokens: int
    """Prompt tokens prefilled by this request."""
    policy: str
    """The routing policy that chose the worker."""


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One message of a `generate` stream: the tokens that are new since the previous chunk."""

    token_ids: list[int]
    text: str
    """Detokenized `token_ids`; empty when the server has no tokenizer."""
    cache: CacheFacts | None
    """Set on the first chunk of a stream only."""
    finish_reason: str
    """Either "length" or "stop" on the last chunk, else empty."""
    request_id: str
    server_ttft_ms: float | None
    """The server's time to first token, on the first chunk that carries tokens."""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole generation: every streamed token, plus the request's cache facts and timings."""

    tokens: list[int]
    text: str
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    pulled_tokens: int
    computed_tokens: int
    ttft_ms: float | None
    """Client-side time from sending the request to the first chunk carrying tokens; None when
    the stream carried no token at all."""
    total_ms: float
    """Client-side time from sending the request to the end of the stream."""
    finish_reason: str
    request_id: str
    policy: str


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """The router's view of one worker for one prompt."""

    worker_id: str
    matched_blocks: int
    """Leading blocks of the prompt the worker holds."""
    cost_ms: float
    """Predicted cost of serving the prompt there; lower is better."""


@dataclass(frozen=True, slots=True)
class RouteResult:
    """The worker the router would pick for a prompt, and why."""

    worker_id: str
    prompt_tokens: int
    matched_tokens: int
    cost_ms: float
    scores: list[WorkerScore]
    policy: str
    session_worker_id: str = ""
    """Where the session's last turn went (empty: no session, or not known to this router)."""
    session_affinity_ms: float = 0.0
    """What that worker's cost was lowered by for the session (included in its score)."""


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """How much of a prompt's block chain one worker holds."""

    worker_id: str
    matched_blocks: int
    matched_tokens: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A prompt's chained block hashes and the per-worker prefix matches in the index."""

    num_blocks: int
    """Full blocks in the prompt; the partial tail is never hashed."""
    block_hashes: list[int]
    matches: list[WorkerMatch]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Prefix-cache figures of one worker, or of the cluster (the sum of its workers': the
    per-worker figures add up to it). Token counts are counted at a request's first prefill."""

    enabled: bool
    """Prefix caching on (off: `--no-prefix-cache`); the cluster: on for every worker."""
    block_size: int
    kv_dtype: str
    """KV dtype, part of the root hash; the cluster: every dtype its workers use, comma-joined."""
    cache_epoch: int
    """Bumped by ClearCache, part of the root hash; the cluster: the highest."""
    num_lookup_hits: int
    """Requests that reused at least one cached block (device, host or pulled)."""
    num_lookup_misses: int
    """Requests that reused nothing (`bypass_cache` requests count as neither)."""
    local_hit_tokens: int
    host_hit_tokens: int
    pulled_hit_tokens: int
    saved_prefill_tokens: int
    """local + host + pulled hit tokens: prompt tokens not prefilled."""
    num_device_evictions: int
    num_host_evictions: int
    num_preemptions: int
    num_entries: int
    """Matchable blocks held, device + host."""
    num_device_entries: int
    num_host_entries: int
    num_bytes: int
    """KV bytes those entries hold."""


@dataclass(frozen=True, slots=True)
class Stats:
    """Cluster-wide counters reported by a coordinator."""

    num_workers: int
    num_live_workers: int
    num_indexed_blocks: int
    num_requests: int
    num_failed_requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    generated_tokens: int
    hit_rate: float
    """cached / prompt tokens over all requests, in [0, 1]."""
    policy: str
    redis_connected: bool
    num_events_applied: int
    num_resyncs: int
    block_size: int
    model: str
    pulled_tokens: int
    """Prompt tokens fetched from peer workers instead of recomputed."""
    num_pulls: int
    num_failed_pulls: int
    num_migrations: int
    """Streams moved to another worker after theirs died mid-stream."""
    routing: str
    """"cache_aware", or "load_only" while the coordinator cannot reach Redis."""
    num_decode_errors: int
    """Malformed KV-event batches the coordinator rejected (never applied to its index)."""
    num_drained_workers: int
    num_rejected_requests: int
    """Calls refused by authentication or a limit (rate, concurrent streams, field sizes)."""
    num_cancelled_requests: int
    """Streams the client cancelled (not counted as failed)."""
    num_slow_streams_cancelled: int
    """Streams the server ended because the client stopped reading (send budget)."""
    num_warm_sessions: int
    """Idle sessions whose chains the workers keep warm (summed over their last reports)."""
    warm_session_bytes: int
    num_sessions_evicted_ttl: int
    num_sessions_evicted_budget: int
    num_sessions_evicted_pressure: int
    num_session_turns_refused: int
    """Turns refused because another turn of their session was in flight."""
    cache: CacheStats
    """Prefix-cache figures summed over the workers' last reports."""
    num_tree_nodes: int
    """Blocks the coordinator's radix tree links to a parent."""
    num_decision_commits: int
    """This replica's routing decisions committed to the decision log (`--decision-log`)."""
    num_decision_lost_commits: int
    """Commits lost to another replica's decision (the decision was made again)."""
    num_decision_forced_commits: int
    num_decisions_unlogged: int
    """Decisions made while the decision log was unreachable (applied here only)."""
    decision_commit_seconds: float
    num_speculative_sends: int
    """Requests sent to their worker before their decision was committed
    (`--speculative-dispatch`)."""
    num_decision_redirects: int
    """Of those, requests aborted on their worker and sent to another after a lost commit."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker actor as its coordinator sees it."""

    worker_id: str
    pid: int
    node: str
    device: str
    num_blocks: int
    num_free_blocks: int
    alive: bool
    cached_tokens: int
    computed_tokens: int
    num_requests: int
    num_running: int
    num_waiting: int
    generation: int
    """Changes whenever the worker restarts or clears its cache."""
    num_indexed_blocks: int
    drained: bool
    """Taken out of routing by an admin `Drain`; it still finishes its running requests."""
    num_warm_sessions: int
    """Idle sessions whose chains this worker keeps warm."""
    warm_session_bytes: int
    cache: CacheStats
    """This worker's prefix-cache figures."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the worker serves besides the base model."""
    kind: str = "kvmesh"
    """`kvmesh` for a kvmesh worker; an external engine's kind (`vllm`, `sglang`)."""


@dataclass(frozen=True, slots=True)
class WorkerIndexView:
    """One worker as a coordinator sees it: its index mirror entries and its pool's content."""

    worker_id: str
    alive: bool
    mirror_hashes: list[int]
    """Blocks the coordinator's in-memory mirror says the worker holds."""
    pool_hashes: list[int]
    """Blocks the worker's pool really holds (registered, matchable)."""
    mirror_generation: int
    mirror_seq: int
    owned: bool
    """The coordinator runs this worker, so `pool_hashes` is meaningful."""


@dataclass(frozen=True, slots=True)
class LinkReport:
    """The parent links of a coordinator's radix tree, as `kvmesh index verify` checks them."""

    num_tree_nodes: int = 0
    num_orphans: int = 0
    """Blocks deeper than 1 whose parent no worker holds (no prompt can reach them)."""
    num_bad_depths: int = 0
    """Blocks whose depth is not their parent's + 1."""
    num_unlinked: int = 0
    """Indexed blocks stored without a parent (their link is unknown, not wrong)."""
    orphan_hashes: list[int] = field(default_factory=list)
    bad_depth_hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class IndexReport:
    """A coordinator's view of the index, for `kvmesh index verify`."""

    workers: list[WorkerIndexView]
    redis_connected: bool
    links: LinkReport = field(default_factory=LinkReport)


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One block of a coordinator's prefix tree."""

    block_hash: int
    parent_hash: int
    """A namespace root (never indexed) for a block at depth 1."""
    depth: int
    """Blocks from the root through this one; 0 = unknown."""
    num_tokens: int
    """The prefix's length in tokens (depth x block size)."""
    device_worker_ids: list[str]
    host_worker_ids: list[str]
    num_hits: int
    """Lookups whose longest match ended on this block (on that coordinator)."""


@dataclass(frozen=True, slots=True)
class IndexTree:
    nodes: list[TreeNode]
    """Tree order (a parent before its children), or the most hit first."""
    num_nodes: int
    """Nodes in the whole tree (more than `nodes` when cut at max_nodes)."""


@dataclass(frozen=True, slots=True)
class ScaleResult:
    """What `Scale` did: workers started and stopped, and how many are alive now."""

    started_worker_ids: list[str]
    stopped_worker_ids: list[str]
    num_workers: int
