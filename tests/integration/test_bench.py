"""`kvmesh bench` against a real deployment (real Redis, real Ray, tiny-random CPU workers)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvmesh.client import cli
from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.sim.report import METRIC_KEYS
from tests.integration.helpers import start_deployment

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def deployment(ray_session: None) -> Iterator[Deployment]:
    dep = start_deployment(num_workers=2, num_blocks=128, policy="kvmesh")
    try:
        yield dep
    finally:
        dep.stop()


def test_bench_reports_the_simulator_metrics_from_real_requests(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["num_groups=2", "users_per_group=8", "system_prompt_len=64", "question_len=8"]
    args = ["bench", "--address", deployment.address, "--workload", "shared_prefix"]
    for arg in small:
        args += ["--workload-arg", arg]
    args += ["--rate", "3", "--duration", "3", "--max-output-tokens", "4", "--json"]
    assert cli.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    (policy, metrics), *_ = doc["policies"].items()
    assert policy == "kvmesh" and not doc["errors"]
    assert set(METRIC_KEYS) <= set(metrics)
    assert metrics["num_succeeded"] == metrics["num_requests"] > 0
    assert 0.0 <= metrics["hit_rate"] <= 1.0 and metrics["ttft_p50_ms"] > 0
    assert sum(metrics["requests_per_worker"].values()) == metrics["num_succeeded"]
