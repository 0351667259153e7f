"""How many workers a deployment starts and what share of a GPU each asks for."""

from __future__ import annotations

import pytest

from kvmesh.coordinator.cluster.deployment import DeploymentConfig
from kvmesh.coordinator.cluster.worker_plan import plan_workers
from kvmesh.coordinator.config import CoordinatorConfig


def test_without_gpus_two_cpu_workers_start_by_default() -> None:
    plan = plan_workers(DeploymentConfig(num_workers=0), num_gpus=0, redis_url="redis://r")
    assert (plan.num_workers, plan.gpus_per_worker) == (2, 0.0)
    assert plan.template.gpu_fraction == 1.0


def test_one_worker_per_gpu_when_the_count_is_left_to_the_cluster() -> None:
    plan = plan_workers(DeploymentConfig(num_workers=0), num_gpus=4, redis_url="redis://r")
    assert (plan.num_workers, plan.gpus_per_worker) == (4, 1.0)


@pytest.mark.parametrize(("num_workers", "share"), [(2, 0.5), (4, 0.25)])
def test_more_workers_than_gpus_split_them_evenly(num_workers: int, share: float) -> None:
    plan = plan_workers(DeploymentConfig(num_workers=num_workers), num_gpus=1, redis_url="r")
    assert plan.gpus_per_worker == share
    assert plan.template.gpu_fraction == share  # the pool is sized from the worker's share


def test_an_explicit_gpu_share_is_kept() -> None:
    config = DeploymentConfig(num_workers=3, gpus_per_worker=1.0)
    assert plan_workers(config, num_gpus=8, redis_url="r").gpus_per_worker == 1.0


def test_the_template_takes_the_coordinators_model_block_size_seed_and_redis() -> None:
    coordinator = CoordinatorConfig(model="tiny-random", block_size=32, seed=7)
    config = DeploymentConfig(coordinator=coordinator, num_workers=1)
    template = plan_workers(config, num_gpus=0, redis_url="redis://h:1").template
    assert (template.model, template.block_size, template.seed) == ("tiny-random", 32, 7)
    assert template.redis_url == "redis://h:1"
