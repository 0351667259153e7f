"""The metrics endpoint and the request log of a real deployment (embedded Redis, local Ray
workers, gRPC coordinator): scrape /metrics over HTTP before and after traffic."""

from __future__ import annotations

import logging
import socket
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.telemetry.request_log import REQUEST_LOGGER
from kvmesh.proto import kvmesh_pb2 as pb
from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PREFIX = [(i * 13) % 250 + 3 for i in range(48)]  # exactly 3 blocks of 16
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def deployment(ray_session: None) -> Iterator[Deployment]:
    d = start_deployment(num_workers=2, num_blocks=64, metrics_port=0)
    yield d
    d.stop()


def scrape(d: Deployment) -> Series:
    assert d.metrics is not None
    with urllib.request.urlopen(f"http://{d.metrics.address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def test_counters_histograms_and_worker_load_move_with_traffic(deployment: Deployment) -> None:
    before = scrape(deployment)
    assert value(before, "kvmesh_redis_connected") == 1
    assert value(before, "kvmesh_workers", state="routable") == 2
    ok_before = value(before, "kvmesh_requests_total", outcome="ok")
    prompt_before = value(before, "kvmesh_prompt_tokens_total")

    stub = stub_for(deployment.address)
    first = generate(stub, PREFIX + [1, 2])
    worker = first[0].cache.worker_id
    wait_for(
        lambda: value(scrape(deployment), "kvmesh_worker_indexed_blocks", worker=worker) >= 3,
        what="the index to hold the prefix",
    )
    second = generate(stub, PREFIX + [7, 7, 7])
    assert second[0].cache.cached_tokens == 48
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(
            pb.GenerateRequest(token_ids=[10**6], sampling=pb.SamplingParams(max_tokens=1))
        ).next()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    after = wait_for(
        lambda: (
            (s := scrape(deployment))
            and value(s, "kvmesh_worker_requests_total", worker=worker) >= 2
            and s
        ),
        what="the workers' next reports",
    )
    assert value(after, "kvmesh_requests_total", outcome="ok") == ok_before + 2
    assert value(after, "kvmesh_requests_total", outcome="invalid") >= 1
    assert value(after, "kvmesh_ttft_seconds_count") >= 2
    assert value(after, "kvmesh_routing_decision_seconds_count") >= 2
    assert value(after, "kvmesh_request_dispatch_seconds_count") >= 2  # stamped and measured
    assert value(after, "kvmesh_prompt_tokens_total") == prompt_before + 50 + 51
    assert value(after, "kvmesh_cached_tokens_total") >= 48
    assert value(after, "kvmesh_computed_tokens_total") >= 50 + 3
    assert value(after, "kvmesh_index_blocks") >= 3
    # A worker's first batch makes the mirror load its snapshot (a resync); later ones apply.
    followed = ("kvmesh_index_events_total", "kvmesh_index_resyncs_total")
    assert sum(value(after, n) for n in followed) > sum(value(before, n) for n in followed)
    assert value(after, "kvmesh_index_event_lag_seconds") > 0
    assert value(after, "kvmesh_worker_up", worker=worker) == 1
    assert value(after, "kvmesh_worker_blocks", worker=worker) == 64
    assert 0 <= value(after, "kvmesh_worker_pool_usage_ratio", worker=worker) <= 1
    assert value(after, "kvmesh_worker_cached_blocks", worker=worker) >= 3


def test_every_request_gets_one_info_line_with_its_cache_facts(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    stub = stub_for(deployment.address)
    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        responses = generate(stub, PREFIX + [5, 5], request_id="trace-me")
    lines = [r for r in caplog.records if r.name == REQUEST_LOGGER]
    assert len(lines) == 1
    fields = lines[0].kvmesh  # type: ignore[attr-defined]
    cache = responses[0].cache
    assert fields["request_id"] == "trace-me" and fields["outcome"] == "ok"
    assert fields["worker"] == cache.worker_id
    assert fields["cached_tokens"] == cache.cached_tokens
    assert fields["computed_tokens"] == cache.computed_tokens
    assert fields["ttft_ms"] is not None and fields["ttft_ms"] > 0
    assert "request_id=trace-me" in lines[0].getMessage()


def test_a_metrics_port_in_use_fails_the_start_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the service's own port left to the OS: a busy default port must not fail it first
        config = DeploymentConfig(
            coordinator=CoordinatorConfig(port=0), num_workers=1, metrics_port=port
        )
        deployment = Deployment(config)
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            deployment.start()
    assert deployment.redis is None and deployment.cluster is None  # nothing else was started
