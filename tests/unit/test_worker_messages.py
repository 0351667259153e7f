"""ListWorkers' rows and the per-worker sums in Stats come from the workers' reports
(`coordinator/service/worker_messages.py`); a cache facts message from a stream's first event
(`coordinator/service/cache_messages.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.service.cache_messages import cache_facts_message
from kvmesh.coordinator.service.worker_messages import (
    cache_totals,
    session_totals,
    workers_message,
)
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.workers.contract.replies import PrefillFacts, WorkerCounters, WorkerInfo
from tests.unit.test_coordinator import info


class ReportedFleet:
    """The workers' shell as the service sees it: the last reports, no fresh ones."""

    def __init__(self, reports: dict[str, WorkerInfo], registry: WorkerRegistry) -> None:
        self.reports = reports
        self.registry = registry

    def infos(self, timeout_s: float = 2.0) -> dict[str, WorkerInfo]:
        return {}

    def latest_info(self, worker_id: str) -> WorkerInfo | None:
        return self.reports.get(worker_id)

    def call_all(self, method: str, *args: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        return {}


def fleet() -> ReportedFleet:
    registry = WorkerRegistry()
    for w in ("w0", "w1", "w2"):
        registry.add(w)
    registry.set_drained("w1", True)
    counters = WorkerCounters(num_warm_sessions=2, warm_session_bytes=100)
    reports = {
        "w0": replace(info("w0"), counters=counters),
        "w1": replace(info("w1"), counters=counters, adapters=("a1",)),
    }  # w2 never reported
    return ReportedFleet(reports, registry)


def test_session_counters_sum_over_the_workers_that_reported() -> None:
    totals = session_totals(fleet())
    assert totals["num_warm_sessions"] == 4 and totals["warm_session_bytes"] == 200
    assert totals["num_sessions_evicted_ttl"] == 0
    assert cache_totals(fleet()).enabled


def test_every_known_worker_gets_a_row_even_without_a_report() -> None:
    message = workers_message(fleet(), lambda w: {"w0": 7}.get(w, 0), lambda w: "kvmesh")
    rows = {w.worker_id: w for w in message.workers}
    assert sorted(rows) == ["w0", "w1", "w2"]
    assert rows["w0"].num_indexed_blocks == 7 and rows["w0"].num_warm_sessions == 2
    assert rows["w1"].drained and list(rows["w1"].adapters) == ["a1"]
    assert rows["w2"].pid == 0 and rows["w2"].kind == "kvmesh"


def test_cache_facts_count_host_hits_as_cached() -> None:
    facts = PrefillFacts(local_tokens=16, host_tokens=16, pulled_tokens=8, computed_tokens=3)
    message = cache_facts_message(StreamEvent((1,), "w0", False, prefill=facts), "kvmesh")
    assert (message.prompt_tokens, message.cached_tokens, message.pulled_tokens) == (43, 32, 8)
    assert message.computed_tokens == 3 and message.policy == "kvmesh"
    bare = cache_facts_message(StreamEvent((), "w1", True), "kvmesh")
    assert bare.worker_id == "w1" and bare.prompt_tokens == 0
