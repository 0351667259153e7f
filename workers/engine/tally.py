"""The worker's running totals, snapshotted into the contract's `WorkerCounters` for reports."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.workers.contract.replies import PrefillFacts, WorkerCounters
from kvmesh.workers.kv.warm_sessions import WarmSessionStats
from kvmesh.workers.model.graph_counts import NO_GRAPHS, GraphCounts
from kvmesh.workers.model.page_reads import PageReads


@dataclass(slots=True)
class WorkerTally:
    """Invariant: prompt_tokens == cached + host_hit (first admissions) + pulled + computed."""

    num_requests: int = 0
    num_finished: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_host_tokens: int = 0
    host_hit_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_pulls: int = 0
    num_failed_pulls: int = 0
    num_pulls_in_admission: int = 0
    prefill_ms_total: float = 0.0
    prefill_tokens_total: int = 0
    num_prefill_steps: int = 0
    prefill_steps_ms: float = 0.0
    num_decode_steps: int = 0
    decode_steps_ms: float = 0.0
    num_decode_step_seqs: int = 0
    engine_host_ms: float = 0.0
    num_lookup_hits: int = 0
    num_lookup_misses: int = 0

    def on_prefilled(self, facts: PrefillFacts, *, looked_up: bool = True) -> None:
        """Count a request's first prefill; `looked_up` False: it bypassed the cache."""
        if looked_up:
            self.num_lookup_hits += facts.cached_tokens > 0
            self.num_lookup_misses += facts.cached_tokens == 0
        self.prompt_tokens += facts.prompt_tokens
        self.cached_tokens += facts.local_tokens
        self.prompt_host_tokens += facts.host_tokens
        self.pulled_tokens += facts.pulled_tokens
        self.computed_tokens += facts.computed_tokens

    def snapshot(
        self,
        num_preemptions: int,
        num_host_blocks: int,
        sessions: WarmSessionStats,
        num_evicted_blocks: int = 0,
        num_host_evicted_blocks: int = 0,
        decode_graphs: GraphCounts = NO_GRAPHS,
        prefill_graphs: GraphCounts = NO_GRAPHS,
        num_layer_loads: int = 0,
        num_copy_engine_loads: int = 0,
        num_queued_decode_steps: int = 0,
        num_dropped_decode_rows: int = 0,
        page_reads: PageReads | None = None,
        num_relocated_blocks: int = 0,
    ) -> WorkerCounters:
        return WorkerCounters(
            num_requests=self.num_requests,
            num_finished=self.num_finished,
            num_failed=self.num_failed,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            host_hit_tokens=self.host_hit_tokens,
            pulled_tokens=self.pulled_tokens,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
            num_pulls=self.num_pulls,
            num_failed_pulls=self.num_failed_pulls,
            num_pulls_in_admission=self.num_pulls_in_admission,
            num_preemptions=num_preemptions,
            num_host_blocks=num_host_blocks,
            num_evicted_blocks=num_evicted_blocks,
            num_lookup_hits=self.num_lookup_hits,
            num_lookup_misses=self.num_lookup_misses,
            num_host_evicted_blocks=num_host_evicted_blocks,
            prefill_ms_per_token=self.prefill_ms_total / max(1, self.prefill_tokens_total),
            num_prefill_steps=self.num_prefill_steps,
            prefill_steps_ms=self.prefill_steps_ms,
            num_decode_steps=self.num_decode_steps,
            decode_steps_ms=self.decode_steps_ms,
            num_decode_step_seqs=self.num_decode_step_seqs,
            engine_host_ms=self.engine_host_ms,
            num_decode_graphs=decode_graphs.num_graphs,
            decode_graph_capture_ms=decode_graphs.capture_ms,
            num_decode_graph_replays=decode_graphs.num_replays,
            num_prefill_graphs=prefill_graphs.num_graphs,
            prefill_graph_capture_ms=prefill_graphs.capture_ms,
            num_prefill_graph_replays=prefill_graphs.num_replays,
            num_host_layer_loads=num_layer_loads,
            num_host_copy_engine_loads=num_copy_engine_loads,
            num_queued_decode_steps=num_queued_decode_steps,
            num_dropped_decode_rows=num_dropped_decode_rows,
            num_page_chunks=page_reads.num_chunks if page_reads else 0,
            num_run_page_chunks=page_reads.num_run_chunks if page_reads else 0,
            num_relocated_blocks=num_relocated_blocks,
            num_warm_sessions=sessions.num_sessions,
            warm_session_bytes=sessions.num_bytes,
            num_sessions_evicted_ttl=sessions.num_evicted_ttl,
            num_sessions_evicted_budget=sessions.num_evicted_budget,
            num_sessions_evicted_pressure=sessions.num_evicted_pressure,
        )

    def on_step(self, prefill: bool, num_seqs: int, wall_ms: float) -> None:
        """Count one engine step (`Worker.step`'s wall, host work included)."""
        if prefill:
            self.num_prefill_steps += 1
            self.prefill_steps_ms += wall_ms
        else:
            self.num_decode_steps += 1
            self.decode_steps_ms += wall_ms
            self.num_decode_step_seqs += num_seqs

    def on_engine_host(self, wall_ms: float) -> None:
        """Count one engine-loop iteration's time outside its step and its idle wait."""
        self.engine_host_ms += wall_ms

    def check_invariants(self) -> None:
        total = self.cached_tokens + self.prompt_host_tokens + self.pulled_tokens
        assert self.prompt_tokens == total + self.computed_tokens
