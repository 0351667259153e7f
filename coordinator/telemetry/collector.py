"""Reads the coordinator, the worker registry, the index follower and the workers' last reports,
and returns every metric as `MetricFamily` values: pure, so a test can call it without a server.

Collection is pull-based and cheap: nothing here calls a worker. Per-worker figures come from
the info each worker last reported to the health loop (every `health_interval_s`), so a scrape
sees load at most that old.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvmesh.coordinator.telemetry.metric_family import MetricFamily, MetricKind, Sample
from kvmesh.coordinator.telemetry.request_metrics import RequestMetrics
from kvmesh.workers.contract.replies import WorkerInfo


class CoordinatorSource(Protocol):
    def stats(self) -> Mapping[str, Any]: ...
    def indexed_blocks_of(self, worker_id: str) -> int: ...


class RegistrySource(Protocol):
    def known(self) -> list[str]: ...
    def alive(self) -> list[str]: ...
    def routable(self) -> list[str]: ...
    def drained(self) -> list[str]: ...


class IndexSource(Protocol):
    @property
    def connected(self) -> bool: ...
    @property
    def num_resyncs(self) -> int: ...
    @property
    def last_event_lag_s(self) -> float | None: ...


# (stats key, metric name, help): the coordinator's counters, exposed as they are.
_TOKEN_COUNTERS = (
    ("prompt_tokens", "kvmesh_prompt_tokens_total", "Prompt tokens of prefilled requests."),
    (
        "cached_tokens",
        "kvmesh_cached_tokens_total",
        "Prompt tokens reused from the serving worker's device pool or host tier.",
    ),
    ("pulled_tokens", "kvmesh_pulled_tokens_total", "Prompt tokens fetched from a peer worker."),
    ("computed_tokens", "kvmesh_computed_tokens_total", "Prompt tokens prefilled from scratch."),
    ("generated_tokens", "kvmesh_generated_tokens_total", "Tokens generated and streamed."),
    ("num_migrations", "kvmesh_migrations_total", "Requests moved after their worker died."),
    (
        "num_decision_commits",
        "kvmesh_decision_commits_total",
        "Routing decisions this replica committed to the decision log.",
    ),
    (
        "num_decision_lost_commits",
        "kvmesh_decision_lost_commits_total",
        "Decision-log commits lost to another replica's decision (decided again).",
    ),
    (
        "num_decision_forced_commits",
        "kvmesh_decision_forced_commits_total",
        "Decisions appended to the log without the check after the retry bound.",
    ),
    (
        "num_decisions_unlogged",
        "kvmesh_decisions_unlogged_total",
        "Decisions made while the decision log was unreachable (applied here only).",
    ),
    (
        "decision_commit_seconds",
        "kvmesh_decision_commit_seconds_total",
        "Time spent committing routing decisions to the decision log.",
    ),
    (
        "num_speculative_sends",
        "kvmesh_speculative_sends_total",
        "Requests sent to their worker before their decision was committed.",
    ),
    (
        "num_decision_redirects",
        "kvmesh_decision_redirects_total",
        "Speculatively sent requests aborted and sent to another worker after a lost commit.",
    ),
)

# (WorkerInfo field or counters field, metric name, kind, help)
_WORKER_GAUGES = (
    ("num_running", "kvmesh_worker_running_requests", "Sequences the worker is running."),
    ("num_waiting", "kvmesh_worker_waiting_requests", "Requests queued (or pulling) on it."),
    ("num_blocks", "kvmesh_worker_blocks", "KV blocks in the worker's device pool."),
    ("num_free_blocks", "kvmesh_worker_free_blocks", "Free device blocks (cached ones included)."),
    ("num_cached_blocks", "kvmesh_worker_cached_blocks", "Registered (matchable) device blocks."),
)
_WORKER_COUNTERS = (
    ("num_requests", "kvmesh_worker_requests_total", "Requests the worker admitted."),
    ("num_failed", "kvmesh_worker_failed_requests_total", "Requests the worker failed alone."),
    ("num_preemptions", "kvmesh_worker_preemptions_total", "Sequences preempted (recomputed)."),
    (
        "num_evicted_blocks",
        "kvmesh_worker_evicted_blocks_total",
        "Cached device blocks reused for new KV (evicted).",
    ),
    ("num_pulls", "kvmesh_worker_pulls_total", "Pulls from peers the worker ran."),
    ("num_failed_pulls", "kvmesh_worker_failed_pulls_total", "Pulls that fell back to compute."),
    (
        "num_pulls_in_admission",
        "kvmesh_worker_pulls_in_admission_total",
        "Same-GPU pulls run inside their request's admission on the engine thread.",
    ),
    (
        "host_hit_tokens",
        "kvmesh_worker_host_hit_tokens_total",
        "Tokens promoted from the host tier.",
    ),
)

# (CacheStats field, metric name, kind, help): the worker's prefix-cache figures (`kvmesh stats`).
_CACHE_FIELDS = (
    (
        "saved_prefill_tokens",
        "kvmesh_worker_saved_prefill_tokens_total",
        MetricKind.COUNTER,
        "Prompt tokens not prefilled thanks to the cache (device, host or pulled).",
    ),
    (
        "num_host_evictions",
        "kvmesh_worker_host_evicted_blocks_total",
        MetricKind.COUNTER,
        "Host-tier blocks dropped to make room.",
    ),
    ("num_bytes", "kvmesh_worker_cache_bytes", MetricKind.GAUGE, "KV bytes of matchable blocks."),
    (
        "cache_epoch",
        "kvmesh_worker_cache_epoch",
        MetricKind.GAUGE,
        "Cache epoch the worker hashes under (ClearCache moves it on).",
    ),
)

# (reason label, counters field) of kvmesh_worker_sessions_evicted_total
_SESSION_EVICTIONS = (
    ("ttl", "num_sessions_evicted_ttl"),
    ("budget", "num_sessions_evicted_budget"),
    ("pressure", "num_sessions_evicted_pressure"),
)


class MetricsCollector:
    def __init__(
        self,
        coordinator: CoordinatorSource,
        registry: RegistrySource,
        latest_info: Callable[[str], WorkerInfo | None],
        requests: RequestMetrics,
        *,
        index: IndexSource | None = None,
        num_gate_rejections: Callable[[], int] | None = None,
        engine_streams: Callable[[], Mapping[str, Mapping[str, int]]] | None = None,
    ) -> None:
        """`engine_streams`: per external engine, its KV-event stream's counts by name
        (`EngineFleet.stream_counts`); None without engines."""
        self.coordinator = coordinator
        self.registry = registry
        self.latest_info = latest_info
        self.requests = requests
        self.index = index
        self.num_gate_rejections = num_gate_rejections
        self.engine_streams = engine_streams

    def collect(self) -> list[MetricFamily]:
        stats = self.coordinator.stats()
        return [
            *self._request_families(),
            *self._token_families(stats),
            *self._index_families(stats),
            *self._fleet_families(),
            *self._worker_families(),
            *self._engine_families(),
        ]

    def _engine_families(self) -> list[MetricFamily]:
        if self.engine_streams is None:
            return []
        streams = self.engine_streams()
        samples = tuple(
            Sample((("engine", engine), ("what", what)), float(count))
            for engine, counts in sorted(streams.items())
            for what, count in sorted(counts.items())
        )
        text = (
            "What each external engine's KV-event stream brought: batches, replayed_batches, "
            "gaps, resets, undecodable (payloads) and skipped_events (unknown or malformed)."
        )
        return [
            MetricFamily(
                "kvmesh_engine_stream_total", MetricKind.COUNTER, text, ("engine", "what"), samples
            )
        ]

    def _request_families(self) -> list[MetricFamily]:
        snap = self.requests.snapshot()
        outcomes = tuple(Sample((("outcome", k),), v) for k, v in snap.outcome_to_count.items())
        families = [
            MetricFamily(
                "kvmesh_requests_total",
                MetricKind.COUNTER,
                "Generate requests by outcome (ok, cancelled, failed, invalid, unavailable).",
                ("outcome",),
                outcomes,
            ),
            MetricFamily(
                "kvmesh_ttft_seconds",
                MetricKind.HISTOGRAM,
                "Time to first token, from the coordinator taking a request to its first tokens.",
                histogram=snap.ttft,
            ),
            MetricFamily(
                "kvmesh_routing_decision_seconds",
                MetricKind.HISTOGRAM,
                "Time the routing policy took to price the workers and choose one.",
                histogram=snap.routing_decision,
            ),
            MetricFamily(
                "kvmesh_request_dispatch_seconds",
                MetricKind.HISTOGRAM,
                "From the coordinator sending a routed request to its worker accepting it.",
                histogram=snap.dispatch,
            ),
        ]
        if self.num_gate_rejections is not None:
            families.append(
                _single(
                    "kvmesh_gate_rejections_total",
                    MetricKind.COUNTER,
                    "Calls refused before the service (auth, rate, stream and size limits).",
                    self.num_gate_rejections(),
                )
            )
        return families

    def _token_families(self, stats: Mapping[str, Any]) -> list[MetricFamily]:
        families = [
            _single(name, MetricKind.COUNTER, text, stats.get(key, 0))
            for key, name, text in _TOKEN_COUNTERS
        ]
        families.append(
            _single(
                "kvmesh_cache_hit_ratio",
                MetricKind.GAUGE,
                "Cached / prompt tokens since start (pulled tokens not counted as hits).",
                stats.get("hit_rate", 0.0),
            )
        )
        return families

    def _index_families(self, stats: Mapping[str, Any]) -> list[MetricFamily]:
        families = [
            _single(
                "kvmesh_index_blocks",
                MetricKind.GAUGE,
                "Blocks in this coordinator's index mirror.",
                stats.get("num_indexed_blocks", 0),
            ),
            _single(
                "kvmesh_index_events_total",
                MetricKind.COUNTER,
                "Block events (stored / removed hashes) the mirror applied from the stream.",
                stats.get("num_events_applied", 0),
            ),
        ]
        if self.index is None:
            return families
        lag = self.index.last_event_lag_s
        families += [
            _single(
                "kvmesh_redis_connected",
                MetricKind.GAUGE,
                "1 while the index follows Redis; 0 means routing by load only.",
                1.0 if self.index.connected else 0.0,
            ),
            _single(
                "kvmesh_index_resyncs_total",
                MetricKind.COUNTER,
                "Worker snapshots reloaded from Redis (start, gaps, new generations).",
                self.index.num_resyncs,
            ),
            _single(
                "kvmesh_index_event_lag_seconds",
                MetricKind.GAUGE,
                "Age of the newest applied event batch when it was applied (Redis clock).",
                0.0 if lag is None else lag,
            ),
        ]
        return families

    def _fleet_families(self) -> list[MetricFamily]:
        known = self.registry.known()
        alive = set(self.registry.alive())
        routable = set(self.registry.routable())
        drained = set(self.registry.drained())
        states = (
            ("routable", len(routable)),
            ("drained", len(drained)),
            ("dead", len(known) - len(alive)),
        )
        return [
            MetricFamily(
                "kvmesh_workers",
                MetricKind.GAUGE,
                "Workers this coordinator knows, by state.",
                ("state",),
                tuple(Sample((("state", s),), n) for s, n in states),
            ),
            MetricFamily(
                "kvmesh_worker_up",
                MetricKind.GAUGE,
                "1 while the worker's actor is alive.",
                ("worker",),
                tuple(Sample((("worker", w),), 1.0 if w in alive else 0.0) for w in known),
            ),
            MetricFamily(
                "kvmesh_worker_indexed_blocks",
                MetricKind.GAUGE,
                "Blocks the index mirror holds for the worker.",
                ("worker",),
                tuple(
                    Sample((("worker", w),), self.coordinator.indexed_blocks_of(w)) for w in known
                ),
            ),
        ]

    def _worker_families(self) -> list[MetricFamily]:
        infos = {w: i for w in self.registry.alive() if (i := self.latest_info(w)) is not None}

        def per_worker(
            name: str, kind: MetricKind, text: str, read: Callable[[WorkerInfo], float]
        ) -> MetricFamily:
            samples = tuple(Sample((("worker", w),), read(i)) for w, i in sorted(infos.items()))
            return MetricFamily(name, kind, text, ("worker",), samples)

        families = [
            per_worker(name, MetricKind.GAUGE, text, _info_field(field))
            for field, name, text in _WORKER_GAUGES
        ]
        families += [
            per_worker(name, MetricKind.COUNTER, text, _counter_field(field))
            for field, name, text in _WORKER_COUNTERS
        ]
        families += [
            per_worker(
                "kvmesh_worker_pool_usage_ratio",
                MetricKind.GAUGE,
                "Device blocks in use by running sequences / all device blocks.",
                lambda i: (i.num_blocks - i.num_free_blocks) / i.num_blocks if i.num_blocks else 0,
            ),
            per_worker(
                "kvmesh_worker_host_blocks",
                MetricKind.GAUGE,
                "Blocks held in the worker's host-memory tier.",
                lambda i: i.counters.num_host_blocks,
            ),
            per_worker(
                "kvmesh_worker_warm_sessions",
                MetricKind.GAUGE,
                "Idle sessions whose chains the worker keeps warm now.",
                lambda i: i.counters.num_warm_sessions,
            ),
            per_worker(
                "kvmesh_worker_warm_session_bytes",
                MetricKind.GAUGE,
                "Device KV bytes the warm sessions' chains hold.",
                lambda i: i.counters.warm_session_bytes,
            ),
            MetricFamily(
                "kvmesh_worker_sessions_evicted_total",
                MetricKind.COUNTER,
                "Sessions no longer kept warm, by reason: idle past the TTL, over the byte "
                "budget (LRU), or device pressure (the pool reused the whole chain).",
                ("worker", "reason"),
                tuple(
                    Sample((("worker", w), ("reason", reason)), float(getattr(i.counters, field)))
                    for w, i in sorted(infos.items())
                    for reason, field in _SESSION_EVICTIONS
                ),
            ),
            MetricFamily(
                "kvmesh_worker_cache_lookups_total",
                MetricKind.COUNTER,
                "Requests that reused at least one cached block (hit) or none (miss).",
                ("worker", "result"),
                tuple(
                    Sample((("worker", w), ("result", result)), float(n))
                    for w, i in sorted(infos.items())
                    for result, n in (
                        ("hit", i.cache.num_lookup_hits),
                        ("miss", i.cache.num_lookup_misses),
                    )
                ),
            ),
            MetricFamily(
                "kvmesh_worker_engine_steps_total",
                MetricKind.COUNTER,
                "Engine steps, by kind: prefill (prompts, no decodes) or decode (a token for "
                "each running sequence).",
                ("worker", "kind"),
                tuple(
                    Sample((("worker", w), ("kind", kind)), float(n))
                    for w, i in sorted(infos.items())
                    for kind, n in (
                        ("prefill", i.counters.num_prefill_steps),
                        ("decode", i.counters.num_decode_steps),
                    )
                ),
            ),
            MetricFamily(
                "kvmesh_worker_engine_step_seconds_total",
                MetricKind.COUNTER,
                "Wall time of the engine's steps, by kind, host work included.",
                ("worker", "kind"),
                tuple(
                    Sample((("worker", w), ("kind", kind)), ms / 1e3)
                    for w, i in sorted(infos.items())
                    for kind, ms in (
                        ("prefill", i.counters.prefill_steps_ms),
                        ("decode", i.counters.decode_steps_ms),
                    )
                ),
            ),
            per_worker(
                "kvmesh_worker_decode_step_sequences_total",
                MetricKind.COUNTER,
                "Sequences over all decode steps (over the decode steps: the mean batch).",
                lambda i: i.counters.num_decode_step_seqs,
            ),
            per_worker(
                "kvmesh_worker_engine_host_seconds_total",
                MetricKind.COUNTER,
                "The engine thread's time between steps: requests taken in, outputs delivered,"
                " KV events published, heartbeats.",
                lambda i: i.counters.engine_host_ms / 1e3,
            ),
            per_worker(
                "kvmesh_worker_decode_graph_captures_total",
                MetricKind.COUNTER,
                "Decode step shapes captured as CUDA graphs (each the first time a step needed"
                " it).",
                lambda i: i.counters.num_decode_graphs,
            ),
            per_worker(
                "kvmesh_worker_decode_graph_capture_seconds_total",
                MetricKind.COUNTER,
                "Time capturing them, inside the decode steps that first needed them.",
                lambda i: i.counters.decode_graph_capture_ms / 1e3,
            ),
            per_worker(
                "kvmesh_worker_decode_graph_replays_total",
                MetricKind.COUNTER,
                "Decode steps replayed from those graphs.",
                lambda i: i.counters.num_decode_graph_replays,
            ),
            per_worker(
                "kvmesh_worker_prefill_graph_captures_total",
                MetricKind.COUNTER,
                "Long-chunk prefill shapes (cache hits read from the pages) captured as CUDA"
                " graphs.",
                lambda i: i.counters.num_prefill_graphs,
            ),
            per_worker(
                "kvmesh_worker_prefill_graph_capture_seconds_total",
                MetricKind.COUNTER,
                "Time capturing them, inside the prefill steps that first needed them.",
                lambda i: i.counters.prefill_graph_capture_ms / 1e3,
            ),
            per_worker(
                "kvmesh_worker_prefill_graph_replays_total",
                MetricKind.COUNTER,
                "Prefill steps replayed from those graphs.",
                lambda i: i.counters.num_prefill_graph_replays,
            ),
            per_worker(
                "kvmesh_worker_host_layer_loads_total",
                MetricKind.COUNTER,
                "Host-tier promotions run layer by layer beside the prefill.",
                lambda i: i.counters.num_host_layer_loads,
            ),
            per_worker(
                "kvmesh_worker_host_copy_engine_loads_total",
                MetricKind.COUNTER,
                "Of those, the ones the GPU's copy engines moved (the rest: the load kernel).",
                lambda i: i.counters.num_host_copy_engine_loads,
            ),
            per_worker(
                "kvmesh_worker_queued_decode_steps_total",
                MetricKind.COUNTER,
                "Decode steps queued on the GPU before the host had read the step before them.",
                lambda i: i.counters.num_queued_decode_steps,
            ),
            per_worker(
                "kvmesh_worker_dropped_decode_rows_total",
                MetricKind.COUNTER,
                "Rows of those steps computed for sequences that had ended meanwhile.",
                lambda i: i.counters.num_dropped_decode_rows,
            ),
            per_worker(
                "kvmesh_worker_page_chunks_total",
                MetricKind.COUNTER,
                "Prefill chunks cuDNN read straight from the paged cache.",
                lambda i: i.counters.num_page_chunks,
            ),
            per_worker(
                "kvmesh_worker_run_page_chunks_total",
                MetricKind.COUNTER,
                "Of those, the ones read as pages of several blocks (blocks in runs).",
                lambda i: i.counters.num_run_page_chunks,
            ),
            per_worker(
                "kvmesh_worker_relocated_blocks_total",
                MetricKind.COUNTER,
                "Cached blocks copied into a prompt's run so its prefix reads as longer pages.",
                lambda i: i.counters.num_relocated_blocks,
            ),
            per_worker(
                "kvmesh_worker_prefill_seconds_per_token",
                MetricKind.GAUGE,
                "Measured prefill cost per token (the router's cost model follows it).",
                lambda i: i.counters.prefill_ms_per_token / 1e3,
            ),
        ]
        families += [
            per_worker(name, kind, text, _cache_field(field))
            for field, name, kind, text in _CACHE_FIELDS
        ]
        return families


def _cache_field(name: str) -> Callable[[WorkerInfo], float]:
    return lambda info: float(getattr(info.cache, name))


def _single(name: str, kind: MetricKind, text: str, value: float) -> MetricFamily:
    return MetricFamily(name, kind, text, (), (Sample((), float(value)),))


def _info_field(name: str) -> Callable[[WorkerInfo], float]:
    return lambda info: float(getattr(info, name))


def _counter_field(name: str) -> Callable[[WorkerInfo], float]:
    return lambda info: float(getattr(info.counters, name))
