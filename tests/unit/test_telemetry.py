"""The pure telemetry core: histograms, request records, the collector's families, the request log
line and JSON logs, all without a server, Ray or Redis."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.histogram import Histogram
from kvmesh.coordinator.telemetry.log_format import (
    LOG_LEVELS,
    JsonFormatter,
    LogConfig,
    configure_logging,
)
from kvmesh.coordinator.telemetry.metric_family import MetricFamily, MetricKind, Sample
from kvmesh.coordinator.telemetry.request_log import RequestLog
from kvmesh.coordinator.telemetry.request_metrics import RequestMetrics
from kvmesh.coordinator.telemetry.request_record import OUTCOMES, RequestRecord
from kvmesh.workers.contract.replies import CacheStats, WorkerCounters, WorkerInfo
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.model.model_config import preset
from tests.unit.test_coordinator import BS, Clock, FakeBackend

MODEL = preset("tiny-random")
PROMPT = [(i * 7) % 250 + 3 for i in range(3 * BS + 2)]


class SteppingClock(Clock):
    """Each read advances time by `step_s`: every measured span is a known multiple of it."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def __call__(self) -> float:
        self.now_s += self.step_s
        return self.now_s


class FakeIndex:
    def __init__(self) -> None:
        self.connected = True
        self.num_resyncs = 3
        self.last_event_lag_s: float | None = 0.25


def worker_info(worker_id: str, *, num_free: int = 60, evicted: int = 0) -> WorkerInfo:
    counters = WorkerCounters(
        num_requests=2,
        num_preemptions=1,
        num_evicted_blocks=evicted,
        num_warm_sessions=3,
        warm_session_bytes=4096,
        num_sessions_evicted_ttl=7,
        num_sessions_evicted_budget=2,
        num_prefill_steps=3,
        prefill_steps_ms=250.0,
        num_decode_steps=10,
        decode_steps_ms=80.0,
        num_decode_step_seqs=24,
        engine_host_ms=45.0,
        num_decode_graphs=5,
        decode_graph_capture_ms=310.0,
        num_decode_graph_replays=40,
        num_prefill_graphs=2,
        prefill_graph_capture_ms=420.0,
        num_prefill_graph_replays=17,
        num_host_layer_loads=9,
        num_host_copy_engine_loads=7,
        num_queued_decode_steps=31,
        num_page_chunks=12,
        num_run_page_chunks=9,
        num_relocated_blocks=11,
        num_dropped_decode_rows=2,
    )
    cache = CacheStats(
        num_lookup_hits=4, num_lookup_misses=6, saved_prefill_tokens=640, cache_epoch=2
    )
    return WorkerInfo(
        worker_id, 1, "node", "cpu", "m", BS, 100, num_free, 30, 2, 1, 1, counters, cache=cache
    )


def make(step_s: float = 0.001, engine_streams=None):  # type: ignore[no-untyped-def]
    registry, mirror = WorkerRegistry(), LockedMirror()
    for w in ("w0", "w1"):
        registry.add(w)
        mirror.load_worker(WorkerId(w), 1, 0, [])
    metrics = RequestMetrics()
    coordinator = Coordinator(
        CoordinatorConfig(block_size=BS),
        MODEL,
        FakeBackend(),
        mirror,
        registry,
        clock=SteppingClock(step_s),
        observers=(metrics,),
    )
    infos = {"w0": worker_info("w0", evicted=5), "w1": worker_info("w1", num_free=100)}
    index = FakeIndex()
    collector = MetricsCollector(
        coordinator,
        registry,
        infos.get,
        metrics,
        index=index,
        num_gate_rejections=lambda: 4,
        engine_streams=engine_streams,
    )
    return coordinator, registry, metrics, collector, index


def families(collector: MetricsCollector) -> dict[str, MetricFamily]:
    return {f.name: f for f in collector.collect()}


# ---- histogram -------------------------------------------------------------------------------


def test_histogram_counts_are_cumulative_and_a_bound_belongs_to_its_own_bucket() -> None:
    h = Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 1.0, 20.0):
        h.observe(value)
    h.check_invariants()
    snap = h.snapshot()
    assert snap.cumulative_counts == (2, 4, 4)
    assert snap.count == 5 and snap.total == pytest.approx(21.65)


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_histogram_rejects_bounds_that_do_not_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(bounds)


# ---- records and families --------------------------------------------------------------------


def test_a_record_with_an_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown outcome"):
        RequestRecord("r", "r", "exploded")


def test_metric_names_follow_prometheus_conventions() -> None:
    with pytest.raises(ValueError, match="must end in _total"):
        MetricFamily("kvmesh_requests", MetricKind.COUNTER, "x")
    with pytest.raises(ValueError, match="must match"):
        MetricFamily("requests_total", MetricKind.COUNTER, "x")
    with pytest.raises(ValueError, match="do not match"):
        MetricFamily("kvmesh_x", MetricKind.GAUGE, "x", ("worker",), (Sample((), 1.0),))


# ---- the coordinator's hooks, read through the collector -------------------------------------


def test_finished_requests_move_outcome_counts_ttft_and_routing_histograms() -> None:
    coordinator, _, metrics, collector, _ = make(step_s=0.001)
    for _ in range(3):
        list(
            coordinator.generate(
                coordinator.prompts.prepare(PROMPT, "", ""), SamplingConfig(max_tokens=2)
            )
        )
    metrics.check_invariants()
    fams = families(collector)
    assert fams["kvmesh_requests_total"].value(outcome="ok") == 3
    assert fams["kvmesh_requests_total"].value(outcome="failed") == 0
    ttft = fams["kvmesh_ttft_seconds"].histogram
    decisions = fams["kvmesh_routing_decision_seconds"].histogram
    assert ttft is not None and decisions is not None
    assert ttft.count == 3 and decisions.count == 3
    dispatch = fams["kvmesh_request_dispatch_seconds"].histogram
    assert dispatch is not None and dispatch.count == 3  # the worker's figure, one a request
    assert dispatch.total == pytest.approx(3 * 0.002)
    # Every clock read advances 1 ms: a decision spans at least one step, and each TTFT spans its
    # request's decision and more.
    assert decisions.total >= 3 * 0.001
    assert ttft.total > decisions.total
    assert fams["kvmesh_prompt_tokens_total"].value() == 3 * len(PROMPT)
    assert fams["kvmesh_computed_tokens_total"].value() == 3 * len(PROMPT)


def test_a_consumer_that_stops_reading_is_counted_as_cancelled_without_a_ttft() -> None:
    coordinator, _, metrics, collector, _ = make()
    stream = coordinator.generate(
        coordinator.prompts.prepare(PROMPT, "", ""), SamplingConfig(max_tokens=4)
    )
    next(iter(stream))
    stream.close()  # type: ignore[attr-defined]
    fams = families(collector)
    assert fams["kvmesh_requests_total"].value(outcome="cancelled") == 1
    ttft = fams["kvmesh_ttft_seconds"].histogram
    assert ttft is not None and ttft.count == 1  # it had its first token before it went away


def test_refused_requests_are_counted_by_outcome() -> None:
    coordinator, registry, _, collector, _ = make()
    coordinator.note_refused("label-1", "invalid", "token id 999 is outside the vocabulary")
    for w in ("w0", "w1"):
        registry.mark_dead(w, "test")
    with pytest.raises(Exception, match="no live worker"):
        coordinator.route(coordinator.prompts.prepare(PROMPT, "", ""))
    coordinator.note_refused("label-2", "unavailable", "no live worker")
    fams = families(collector)
    assert fams["kvmesh_requests_total"].value(outcome="invalid") == 1
    assert fams["kvmesh_requests_total"].value(outcome="unavailable") == 1
    assert {s.labels[0][1] for s in fams["kvmesh_requests_total"].samples} == set(OUTCOMES)


def test_worker_families_read_each_live_workers_last_report() -> None:
    _, registry, _, collector, _ = make()
    registry.set_drained("w1", True)
    fams = families(collector)
    assert fams["kvmesh_worker_free_blocks"].value(worker="w0") == 60
    assert fams["kvmesh_worker_pool_usage_ratio"].value(worker="w0") == pytest.approx(0.4)
    assert fams["kvmesh_worker_pool_usage_ratio"].value(worker="w1") == 0
    assert fams["kvmesh_worker_evicted_blocks_total"].value(worker="w0") == 5
    assert fams["kvmesh_worker_preemptions_total"].value(worker="w1") == 1
    assert fams["kvmesh_worker_running_requests"].value(worker="w0") == 2
    assert fams["kvmesh_worker_waiting_requests"].value(worker="w0") == 1
    assert fams["kvmesh_worker_warm_sessions"].value(worker="w0") == 3
    assert fams["kvmesh_worker_warm_session_bytes"].value(worker="w1") == 4096
    evicted = fams["kvmesh_worker_sessions_evicted_total"]
    assert evicted.value(worker="w0", reason="ttl") == 7
    assert evicted.value(worker="w0", reason="budget") == 2
    assert evicted.value(worker="w1", reason="pressure") == 0
    assert fams["kvmesh_workers"].value(state="routable") == 1
    assert fams["kvmesh_workers"].value(state="drained") == 1
    assert fams["kvmesh_worker_cache_lookups_total"].value(worker="w0", result="hit") == 4
    assert fams["kvmesh_worker_cache_lookups_total"].value(worker="w0", result="miss") == 6
    assert fams["kvmesh_worker_saved_prefill_tokens_total"].value(worker="w0") == 640
    steps, step_s = (
        fams["kvmesh_worker_engine_steps_total"],
        fams["kvmesh_worker_engine_step_seconds_total"],
    )
    assert (steps.value(worker="w0", kind="prefill"), steps.value(worker="w0", kind="decode")) == (
        3,
        10,
    )
    assert step_s.value(worker="w0", kind="prefill") == pytest.approx(0.25)
    assert step_s.value(worker="w0", kind="decode") == pytest.approx(0.08)
    assert fams["kvmesh_worker_decode_step_sequences_total"].value(worker="w0") == 24
    host_s = fams["kvmesh_worker_engine_host_seconds_total"]
    assert host_s.value(worker="w0") == pytest.approx(0.045)
    assert fams["kvmesh_worker_decode_graph_captures_total"].value(worker="w0") == 5
    capture_s = fams["kvmesh_worker_decode_graph_capture_seconds_total"]
    assert capture_s.value(worker="w0") == pytest.approx(0.31)
    assert fams["kvmesh_worker_decode_graph_replays_total"].value(worker="w0") == 40
    assert fams["kvmesh_worker_prefill_graph_captures_total"].value(worker="w0") == 2
    prefill_s = fams["kvmesh_worker_prefill_graph_capture_seconds_total"]
    assert prefill_s.value(worker="w0") == pytest.approx(0.42)
    assert fams["kvmesh_worker_prefill_graph_replays_total"].value(worker="w0") == 17
    assert fams["kvmesh_worker_host_layer_loads_total"].value(worker="w0") == 9
    assert fams["kvmesh_worker_host_copy_engine_loads_total"].value(worker="w0") == 7
    assert fams["kvmesh_worker_queued_decode_steps_total"].value(worker="w0") == 31
    assert fams["kvmesh_worker_page_chunks_total"].value(worker="w0") == 12
    assert fams["kvmesh_worker_run_page_chunks_total"].value(worker="w0") == 9
    assert fams["kvmesh_worker_relocated_blocks_total"].value(worker="w0") == 11
    assert fams["kvmesh_worker_dropped_decode_rows_total"].value(worker="w0") == 2
    assert fams["kvmesh_worker_cache_epoch"].value(worker="w1") == 2
    registry.mark_dead("w0", "test")
    fams = families(collector)
    assert fams["kvmesh_worker_up"].value(worker="w0") == 0
    assert fams["kvmesh_worker_free_blocks"].value(worker="w0") is None  # dead: no load series
    assert fams["kvmesh_workers"].value(state="dead") == 1


def test_index_families_follow_the_follower_and_redis_state() -> None:
    _, _, _, collector, index = make()
    fams = families(collector)
    assert fams["kvmesh_redis_connected"].value() == 1
    assert fams["kvmesh_index_event_lag_seconds"].value() == 0.25
    assert fams["kvmesh_index_resyncs_total"].value() == 3
    assert fams["kvmesh_gate_rejections_total"].value() == 4
    index.connected = False
    assert families(collector)["kvmesh_redis_connected"].value() == 0


# ---- logs ------------------------------------------------------------------------------------


def test_the_request_log_writes_one_line_with_the_cache_facts() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("kvmesh.test.requests")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        RequestLog(logger).on_request_done(
            RequestRecord(
                "internal",
                "client-label",
                "ok",
                worker_id="w1",
                ttft_s=0.0125,
                prompt_tokens=67,
                cached_tokens=48,
                pulled_tokens=16,
                computed_tokens=3,
                generated_tokens=4,
            )
        )
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert doc["level"] == "info" and doc["logger"] == "kvmesh.test.requests"
    assert doc["request_id"] == "client-label" and doc["worker"] == "w1"
    assert (doc["cached_tokens"], doc["pulled_tokens"], doc["computed_tokens"]) == (48, 16, 3)
    assert doc["ttft_ms"] == 12.5
    assert "cached_tokens=48" in doc["message"] and "ttft_ms=12.5" in doc["message"]


def test_configure_logging_sets_the_level_and_keeps_ray_quiet() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("ray").level)
    stream = io.StringIO()
    try:
        configure_logging(LogConfig("info", json_lines=True), stream)
        logging.getLogger("kvmesh.x").info("hello")
        logging.getLogger("kvmesh.x").debug("hidden")
        assert logging.getLogger("ray").level == logging.WARNING
        lines = stream.getvalue().splitlines()
        assert [json.loads(line)["message"] for line in lines] == ["hello"]
        with pytest.raises(ValueError, match="unknown log level"):
            LogConfig("loud")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("ray").setLevel(saved[2])


def test_the_cli_offers_exactly_the_log_levels_the_server_knows() -> None:
    from kvmesh.client.environment import LOG_LEVELS as CLI_LEVELS

    assert CLI_LEVELS == LOG_LEVELS


@pytest.mark.parametrize("command", ["up", "serve"])
def test_up_and_serve_take_the_metrics_and_log_flags(command: str) -> None:
    from kvmesh.client.environment import read_environment
    from kvmesh.client.parser import build_parser
    from kvmesh.coordinator.cluster.launcher import deployment_config, log_config

    parser = build_parser(read_environment({"KVMESH_REDIS_URL": "redis://r:6379/0"}))
    args = parser.parse_args([command])
    assert (args.metrics_port, args.log_level, args.log_json) == (0, "info", False)
    assert deployment_config(args, embedded_redis=command == "up").metrics_port is None  # 0: off
    args = parser.parse_args(
        [command, "--metrics-port", "9400", "--log-level", "debug", "--log-json"]
    )
    assert log_config(args) == LogConfig("debug", json_lines=True)
    assert deployment_config(args, embedded_redis=command == "up").metrics_port == 9400
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--log-level", "loud"])


def test_metrics_and_log_defaults_come_from_the_environment_and_flags_win() -> None:
    from kvmesh.client.environment import read_environment
    from kvmesh.client.parser import build_parser

    env = {"KVMESH_METRICS_PORT": "9400", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_LOG_JSON": "true"}
    parser = build_parser(read_environment(env))
    args = parser.parse_args(["up"])
    assert (args.metrics_port, args.log_level, args.log_json) == (9400, "warning", True)
    args = parser.parse_args(["up", "--metrics-port", "0", "--log-level", "debug", "--no-log-json"])
    assert (args.metrics_port, args.log_level, args.log_json) == (0, "debug", False)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVMESH_METRICS_PORT", "http"),
        ("KVMESH_METRICS_PORT", "70000"),
        ("KVMESH_LOG_LEVEL", "loud"),
        ("KVMESH_LOG_JSON", "maybe"),
    ],
)
def test_bad_metrics_and_log_variables_are_named_in_the_error(name: str, value: str) -> None:
    from kvmesh.client.environment import read_environment

    with pytest.raises(ValueError, match=name):
        read_environment({name: value})


def test_engine_streams_are_exported_per_engine_and_only_with_engines() -> None:
    coordinator, registry, metrics, collector, index = make()
    assert "kvmesh_engine_stream_total" not in families(collector)
    counts = {"a": {"batches": 7, "gaps": 1}, "b": {"batches": 2, "gaps": 0}}
    with_engines = MetricsCollector(
        coordinator, registry, lambda w: None, metrics, index=index, engine_streams=lambda: counts
    )
    stream = families(with_engines)["kvmesh_engine_stream_total"]
    assert stream.value(engine="a", what="batches") == 7
    assert stream.value(engine="a", what="gaps") == 1
    assert stream.value(engine="b", what="batches") == 2
    counts["a"]["gaps"] = 3  # read at every scrape, not copied once
    assert families(with_engines)["kvmesh_engine_stream_total"].value(engine="a", what="gaps") == 3
