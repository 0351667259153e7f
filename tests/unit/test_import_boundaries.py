"""The coordinator's core runs without torch and Ray; its gRPC shell without Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Every coordinator module but the Ray shells (cluster.py, fleet.py, ray_runtime.py, link_setup.py,
# deployment.py, launcher.py) and the gRPC shells, which are checked separately below.
CORE = [
    "kvmesh.coordinator.coordinator",
    "kvmesh.coordinator.contract",
    "kvmesh.coordinator.prompt_preparer",
    "kvmesh.coordinator.fleet_view",
    "kvmesh.coordinator.config",
    "kvmesh.coordinator.cluster.registry",
    "kvmesh.coordinator.cluster.side_door",
    "kvmesh.coordinator.cluster.redis_server",
    "kvmesh.coordinator.cluster.worker_plan",
    "kvmesh.coordinator.index.follower",
    "kvmesh.coordinator.index.locked_mirror",
    "kvmesh.coordinator.index.store",
    "kvmesh.coordinator.engines.vllm_events",
    "kvmesh.coordinator.engines.sglang_events",
    "kvmesh.coordinator.engines.chain_translator",
    "kvmesh.coordinator.engines.engine_backend",
    "kvmesh.coordinator.engines.engine_fleet",
    "kvmesh.coordinator.routing.router",
    "kvmesh.coordinator.routing.kvmesh_policy",
    "kvmesh.coordinator.routing.kvmesh_weights",
    "kvmesh.coordinator.routing.simple_policies",
    "kvmesh.coordinator.routing.baselines",
    "kvmesh.coordinator.routing.transfer_planner",
    "kvmesh.coordinator.service.admin",
    "kvmesh.coordinator.service.auth",
    "kvmesh.coordinator.service.limits",
    "kvmesh.coordinator.service.detokenizer",
    "kvmesh.coordinator.service.request_messages",
    "kvmesh.coordinator.service.worker_messages",
    "kvmesh.coordinator.decision_replica",
    "kvmesh.coordinator.sim.simulator",
    "kvmesh.coordinator.telemetry.collector",
    "kvmesh.coordinator.telemetry.request_log",
    "kvmesh.coordinator.telemetry.request_counters",
    "kvmesh.coordinator.telemetry.log_format",
    "kvmesh.workers.contract.requests",
    "kvmesh.workers.contract.replies",
    "kvmesh.workers.request_channel",
]
SERVICE = [
    "kvmesh.coordinator.service.servicer",
    "kvmesh.coordinator.service.grpc_server",
    "kvmesh.coordinator.service.interceptor",
]


def import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess[str]:
    """Import `modules` in a fresh interpreter in which `blocked` packages cannot be imported."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            importlib.import_module(module)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )


def test_the_coordinator_core_imports_without_torch_and_ray() -> None:
    result = import_with_blocked(CORE, ["torch", "ray", "triton"])
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_grpc_service_imports_without_ray() -> None:
    result = import_with_blocked(SERVICE, ["ray"])
    assert result.returncode == 0, result.stderr[-2000:]


def test_only_the_metrics_exporter_imports_prometheus_client() -> None:
    pure = [m for m in CORE + SERVICE if m.startswith("kvmesh.coordinator")]
    assert import_with_blocked(pure, ["prometheus_client"]).returncode == 0
    exporter = import_with_blocked(["kvmesh.coordinator.telemetry.exporter"], ["prometheus_client"])
    assert exporter.returncode != 0


@pytest.mark.parametrize(
    "shell", ["kvmesh.coordinator.cluster.cluster", "kvmesh.coordinator.cluster.ray_runtime"]
)
def test_the_block_really_bites(shell: str) -> None:
    """The Ray shell imports ray, so blocking ray must fail it (else the checks above prove
    nothing)."""
    assert import_with_blocked([shell], ["ray"]).returncode != 0
