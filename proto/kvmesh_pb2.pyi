from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_MODE_CONCURRENT: _ClassVar[TurnMode]
    TURN_MODE_REFUSE: _ClassVar[TurnMode]
    TURN_MODE_QUEUE: _ClassVar[TurnMode]
TURN_MODE_CONCURRENT: TurnMode
TURN_MODE_REFUSE: TurnMode
TURN_MODE_QUEUE: TurnMode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_p: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "prompt", "sampling", "session_id", "cache_salt", "worker_id", "request_id", "turn_mode", "bypass_cache", "adapter", "media")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_MODE_FIELD_NUMBER: _ClassVar[int]
    BYPASS_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    sampling: SamplingParams
    session_id: str
    cache_salt: str
    worker_id: str
    request_id: str
    turn_mode: TurnMode
    bypass_cache: bool
    adapter: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., worker_id: _Optional[str] = ..., request_id: _Optional[str] = ..., turn_mode: _Optional[_Union[TurnMode, str]] = ..., bypass_cache: _Optional[bool] = ..., adapter: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("hash", "offset", "length")
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    hash: int
    offset: int
    length: int
    def __init__(self, hash: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class CacheFacts(_message.Message):
    __slots__ = ("worker_id", "prompt_tokens", "cached_tokens", "pulled_tokens", "computed_tokens", "policy")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    pulled_tokens: int
    computed_tokens: int
    policy: str
    def __init__(self, worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "cache", "finish_reason", "ttft_ms", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    cache: CacheFacts
    finish_reason: str
    ttft_ms: float
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., cache: _Optional[_Union[CacheFacts, _Mapping]] = ..., finish_reason: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("token_ids", "prompt", "session_id", "cache_salt", "max_tokens", "bypass_cache", "adapter", "media")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYPASS_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    session_id: str
    cache_salt: str
    max_tokens: int
    bypass_cache: bool
    adapter: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., bypass_cache: _Optional[bool] = ..., adapter: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker_id", "matched_blocks", "cost_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    matched_blocks: int
    cost_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., cost_ms: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "prompt_tokens", "matched_tokens", "cost_ms", "scores", "policy", "session_worker_id", "session_affinity_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SESSION_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_AFFINITY_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    prompt_tokens: int
    matched_tokens: int
    cost_ms: float
    scores: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    policy: str
    session_worker_id: str
    session_affinity_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., cost_ms: _Optional[float] = ..., scores: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., policy: _Optional[str] = ..., session_worker_id: _Optional[str] = ..., session_affinity_ms: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "prompt", "cache_salt", "adapter", "media")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    cache_salt: str
    adapter: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., cache_salt: _Optional[str] = ..., adapter: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "matched_blocks", "matched_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    matched_blocks: int
    matched_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "block_hashes", "matches")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    matches: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    def __init__(self, num_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., matches: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("enabled", "block_size", "kv_dtype", "cache_epoch", "num_lookup_hits", "num_lookup_misses", "local_hit_tokens", "host_hit_tokens", "pulled_hit_tokens", "saved_prefill_tokens", "num_device_evictions", "num_host_evictions", "num_preemptions", "num_entries", "num_device_entries", "num_host_entries", "num_bytes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    block_size: int
    kv_dtype: str
    cache_epoch: int
    num_lookup_hits: int
    num_lookup_misses: int
    local_hit_tokens: int
    host_hit_tokens: int
    pulled_hit_tokens: int
    saved_prefill_tokens: int
    num_device_evictions: int
    num_host_evictions: int
    num_preemptions: int
    num_entries: int
    num_device_entries: int
    num_host_entries: int
    num_bytes: int
    def __init__(self, enabled: _Optional[bool] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., cache_epoch: _Optional[int] = ..., num_lookup_hits: _Optional[int] = ..., num_lookup_misses: _Optional[int] = ..., local_hit_tokens: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., pulled_hit_tokens: _Optional[int] = ..., saved_prefill_tokens: _Optional[int] = ..., num_device_evictions: _Optional[int] = ..., num_host_evictions: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_entries: _Optional[int] = ..., num_device_entries: _Optional[int] = ..., num_host_entries: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_workers", "num_live_workers", "num_indexed_blocks", "num_requests", "num_failed_requests", "prompt_tokens", "cached_tokens", "computed_tokens", "generated_tokens", "hit_rate", "policy", "redis_connected", "num_events_applied", "num_resyncs", "block_size", "model", "pulled_tokens", "num_pulls", "num_failed_pulls", "num_migrations", "routing", "num_decode_errors", "num_drained_workers", "num_rejected_requests", "num_cancelled_requests", "num_slow_streams_cancelled", "num_warm_sessions", "warm_session_bytes", "num_sessions_evicted_ttl", "num_sessions_evicted_budget", "num_sessions_evicted_pressure", "num_session_turns_refused", "cache", "num_tree_nodes", "num_decision_commits", "num_decision_lost_commits", "num_decision_forced_commits", "num_decisions_unlogged", "decision_commit_seconds", "num_speculative_sends", "num_decision_redirects")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOW_STREAMS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    NUM_WARM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WARM_SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_EVICTED_TTL_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_EVICTED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_EVICTED_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSION_TURNS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISION_COMMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISION_LOST_COMMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISION_FORCED_COMMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISIONS_UNLOGGED_FIELD_NUMBER: _ClassVar[int]
    DECISION_COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_SENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISION_REDIRECTS_FIELD_NUMBER: _ClassVar[int]
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
    policy: str
    redis_connected: bool
    num_events_applied: int
    num_resyncs: int
    block_size: int
    model: str
    pulled_tokens: int
    num_pulls: int
    num_failed_pulls: int
    num_migrations: int
    routing: str
    num_decode_errors: int
    num_drained_workers: int
    num_rejected_requests: int
    num_cancelled_requests: int
    num_slow_streams_cancelled: int
    num_warm_sessions: int
    warm_session_bytes: int
    num_sessions_evicted_ttl: int
    num_sessions_evicted_budget: int
    num_sessions_evicted_pressure: int
    num_session_turns_refused: int
    cache: CacheStats
    num_tree_nodes: int
    num_decision_commits: int
    num_decision_lost_commits: int
    num_decision_forced_commits: int
    num_decisions_unlogged: int
    decision_commit_seconds: float
    num_speculative_sends: int
    num_decision_redirects: int
    def __init__(self, num_workers: _Optional[int] = ..., num_live_workers: _Optional[int] = ..., num_indexed_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_failed_requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ..., policy: _Optional[str] = ..., redis_connected: _Optional[bool] = ..., num_events_applied: _Optional[int] = ..., num_resyncs: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., pulled_tokens: _Optional[int] = ..., num_pulls: _Optional[int] = ..., num_failed_pulls: _Optional[int] = ..., num_migrations: _Optional[int] = ..., routing: _Optional[str] = ..., num_decode_errors: _Optional[int] = ..., num_drained_workers: _Optional[int] = ..., num_rejected_requests: _Optional[int] = ..., num_cancelled_requests: _Optional[int] = ..., num_slow_streams_cancelled: _Optional[int] = ..., num_warm_sessions: _Optional[int] = ..., warm_session_bytes: _Optional[int] = ..., num_sessions_evicted_ttl: _Optional[int] = ..., num_sessions_evicted_budget: _Optional[int] = ..., num_sessions_evicted_pressure: _Optional[int] = ..., num_session_turns_refused: _Optional[int] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., num_tree_nodes: _Optional[int] = ..., num_decision_commits: _Optional[int] = ..., num_decision_lost_commits: _Optional[int] = ..., num_decision_forced_commits: _Optional[int] = ..., num_decisions_unlogged: _Optional[int] = ..., decision_commit_seconds: _Optional[float] = ..., num_speculative_sends: _Optional[int] = ..., num_decision_redirects: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "pid", "node", "device", "num_blocks", "num_free_blocks", "alive", "cached_tokens", "computed_tokens", "num_requests", "num_running", "num_waiting", "generation", "num_indexed_blocks", "drained", "num_warm_sessions", "warm_session_bytes", "cache", "adapters", "kind")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    NUM_WARM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WARM_SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
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
    num_indexed_blocks: int
    drained: bool
    num_warm_sessions: int
    warm_session_bytes: int
    cache: CacheStats
    adapters: _containers.RepeatedScalarFieldContainer[str]
    kind: str
    def __init__(self, worker_id: _Optional[str] = ..., pid: _Optional[int] = ..., node: _Optional[str] = ..., device: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., alive: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., generation: _Optional[int] = ..., num_indexed_blocks: _Optional[int] = ..., drained: _Optional[bool] = ..., num_warm_sessions: _Optional[int] = ..., warm_session_bytes: _Optional[int] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., adapters: _Optional[_Iterable[str]] = ..., kind: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "undrain")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    undrain: bool
    def __init__(self, worker_id: _Optional[str] = ..., undrain: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained_worker_ids",)
    DRAINED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    drained_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, drained_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCleared(_message.Message):
    __slots__ = ("worker_id", "num_freed_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_freed_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., num_freed_blocks: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ("workers", "cache_epoch")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerCleared]
    cache_epoch: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerCleared, _Mapping]]] = ..., cache_epoch: _Optional[int] = ...) -> None: ...

class VerifyIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerIndexView(_message.Message):
    __slots__ = ("worker_id", "alive", "mirror_hashes", "pool_hashes", "mirror_generation", "mirror_seq", "owned")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    MIRROR_HASHES_FIELD_NUMBER: _ClassVar[int]
    POOL_HASHES_FIELD_NUMBER: _ClassVar[int]
    MIRROR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MIRROR_SEQ_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    alive: bool
    mirror_hashes: _containers.RepeatedScalarFieldContainer[int]
    pool_hashes: _containers.RepeatedScalarFieldContainer[int]
    mirror_generation: int
    mirror_seq: int
    owned: bool
    def __init__(self, worker_id: _Optional[str] = ..., alive: _Optional[bool] = ..., mirror_hashes: _Optional[_Iterable[int]] = ..., pool_hashes: _Optional[_Iterable[int]] = ..., mirror_generation: _Optional[int] = ..., mirror_seq: _Optional[int] = ..., owned: _Optional[bool] = ...) -> None: ...

class VerifyIndexResponse(_message.Message):
    __slots__ = ("workers", "redis_connected", "num_tree_nodes", "num_orphans", "num_bad_depths", "num_unlinked", "orphan_hashes", "bad_depth_hashes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_ORPHANS_FIELD_NUMBER: _ClassVar[int]
    NUM_BAD_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNLINKED_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_HASHES_FIELD_NUMBER: _ClassVar[int]
    BAD_DEPTH_HASHES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerIndexView]
    redis_connected: bool
    num_tree_nodes: int
    num_orphans: int
    num_bad_depths: int
    num_unlinked: int
    orphan_hashes: _containers.RepeatedScalarFieldContainer[int]
    bad_depth_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerIndexView, _Mapping]]] = ..., redis_connected: _Optional[bool] = ..., num_tree_nodes: _Optional[int] = ..., num_orphans: _Optional[int] = ..., num_bad_depths: _Optional[int] = ..., num_unlinked: _Optional[int] = ..., orphan_hashes: _Optional[_Iterable[int]] = ..., bad_depth_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class IndexTreeRequest(_message.Message):
    __slots__ = ("max_nodes", "hottest")
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    HOTTEST_FIELD_NUMBER: _ClassVar[int]
    max_nodes: int
    hottest: bool
    def __init__(self, max_nodes: _Optional[int] = ..., hottest: _Optional[bool] = ...) -> None: ...

class IndexTreeNode(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "depth", "num_tokens", "device_worker_ids", "host_worker_ids", "num_hits")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    parent_hash: int
    depth: int
    num_tokens: int
    device_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    host_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    num_hits: int
    def __init__(self, block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., depth: _Optional[int] = ..., num_tokens: _Optional[int] = ..., device_worker_ids: _Optional[_Iterable[str]] = ..., host_worker_ids: _Optional[_Iterable[str]] = ..., num_hits: _Optional[int] = ...) -> None: ...

class IndexTreeResponse(_message.Message):
    __slots__ = ("nodes", "num_nodes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[IndexTreeNode]
    num_nodes: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[IndexTreeNode, _Mapping]]] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("num_workers", "drain_timeout_s")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    drain_timeout_s: float
    def __init__(self, num_workers: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("started_worker_ids", "stopped_worker_ids", "num_workers")
    STARTED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    started_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    stopped_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    num_workers: int
    def __init__(self, started_worker_ids: _Optional[_Iterable[str]] = ..., stopped_worker_ids: _Optional[_Iterable[str]] = ..., num_workers: _Optional[int] = ...) -> None: ...
