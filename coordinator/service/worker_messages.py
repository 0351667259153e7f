"""The fleet's workers as wire messages: ListWorkers' rows and the per-worker sums in Stats,
from the workers' last reports (the health watcher's: Stats never waits on a worker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.coordinator.service.admin import Fleet
from kvmesh.coordinator.service.cache_messages import cache_stats_message
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.workers.contract.replies import CacheStats

SESSION_COUNTERS = (
    "num_warm_sessions",
    "warm_session_bytes",
    "num_sessions_evicted_ttl",
    "num_sessions_evicted_budget",
    "num_sessions_evicted_pressure",
)
"""Warm-session counters Stats sums over the workers."""


def workers_message(
    cluster: Fleet,
    indexed_blocks_of: Callable[[str], int],
    worker_kind: Callable[[str], str],
) -> pb.ListWorkersResponse:
    """Every known worker: its fresh report (else its last one), liveness, drain, kind and the
    blocks this coordinator's index holds for it."""
    infos = cluster.infos()
    registry = cluster.registry
    out = []
    for w in registry.known():
        i = infos.get(w) or cluster.latest_info(w)
        report: dict[str, Any] = {}
        if i is not None:
            report = {
                "pid": i.pid,
                "node": i.node,
                "device": i.device,
                "num_blocks": i.num_blocks,
                "num_free_blocks": i.num_free_blocks,
                "cached_tokens": i.counters.cached_tokens,
                "computed_tokens": i.counters.computed_tokens,
                "num_requests": i.counters.num_requests,
                "num_running": i.num_running,
                "num_waiting": i.num_waiting,
                "generation": i.generation,
                "num_warm_sessions": i.counters.num_warm_sessions,
                "warm_session_bytes": i.counters.warm_session_bytes,
                "cache": cache_stats_message(i.cache),
                "adapters": list(i.adapters),
            }
        out.append(
            pb.WorkerInfo(
                worker_id=w,
                alive=registry.is_alive(w),
                num_indexed_blocks=indexed_blocks_of(w),
                drained=registry.is_drained(w),
                kind=worker_kind(w),
                **report,
            )
        )
    return pb.ListWorkersResponse(workers=out)


def cache_totals(cluster: Fleet) -> CacheStats:
    """The workers' last cache reports, summed (so ListWorkers' figures add up to it)."""
    reports = [cluster.latest_info(w) for w in cluster.registry.known()]
    return CacheStats.total(i.cache for i in reports if i is not None)


def session_totals(cluster: Fleet) -> dict[str, int]:
    """Warm-session counters summed over the workers' last reports."""
    totals = dict.fromkeys(SESSION_COUNTERS, 0)
    for w in cluster.registry.known():
        info = cluster.latest_info(w)
        if info is None:
            continue
        for name in totals:
            totals[name] += getattr(info.counters, name)
    return totals
