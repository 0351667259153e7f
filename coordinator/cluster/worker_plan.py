"""The worker plan: how many workers a deployment starts, each one's GPU share, and the config
they all start from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmesh.workers.config import WorkerConfig

if TYPE_CHECKING:
    from kvmesh.coordinator.cluster.deployment import DeploymentConfig


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    num_workers: int
    """Workers to start."""
    gpus_per_worker: float
    """GPU share each worker asks Ray for (0: none)."""
    template: WorkerConfig
    """Every worker's config but its id."""


def plan_workers(config: DeploymentConfig, num_gpus: int, redis_url: str) -> WorkerPlan:
    """The plan for `config` on a Ray cluster of `num_gpus` GPUs: one worker per GPU (2 without
    GPUs) unless `num_workers` says otherwise; a whole GPU each when there are enough, else an
    even split."""
    cc = config.coordinator
    num_workers = config.num_workers or max(num_gpus, 2 if not num_gpus else num_gpus)
    gpus_per_worker = config.gpus_per_worker
    if gpus_per_worker < 0:
        gpus_per_worker = 0.0 if not num_gpus else min(1.0, num_gpus / num_workers)
    template = replace(
        config.worker,
        model=cc.model,
        block_size=cc.block_size,
        redis_url=redis_url,
        seed=cc.seed,
        gpu_fraction=gpus_per_worker if 0 < gpus_per_worker < 1 else 1.0,
    )
    return WorkerPlan(num_workers, gpus_per_worker, template)
