"""The Ray runtime a deployment runs on: joined when this process already has one, else started
here without the secrets of our environment, and shut down only by the one who started it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

import ray

SECRET_ENV_VARS = ("KVMESH_ADMIN_TOKEN", "KVMESH_AUTH_TOKEN", "KVMESH_TOKEN", "KVMESH_REDIS_URL")
"""Variables that may hold a secret: read once by the CLI into the config, never inherited by
Ray's processes (raylet, GCS, every worker). Workers get the Redis URL in their config."""


class RayRuntime:
    """Ray for one deployment. `address`: the cluster to join (`auto`, `host:6379`); empty
    starts a private local Ray (unless this process already runs one), never whatever cluster
    `ray start` last recorded."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._started = False

    def start(self) -> None:
        if ray.is_initialized():
            return
        with without_secrets(os.environ):  # a local start spawns Ray's processes from ours
            # Ray's driver loggers go through our handlers (level, format, JSON) instead of
            # a handler of Ray's own; the workers' output stays in Ray's session logs.
            ray.init(
                address=self.address or "local",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        self._started = True

    def num_gpus(self) -> int:
        """GPUs in the Ray cluster (0 without any)."""
        return int(ray.cluster_resources().get("GPU", 0))

    def stop(self) -> None:
        """Shut Ray down if `start` started it; a joined Ray keeps running."""
        if self._started and ray.is_initialized():
            ray.shutdown()
            self._started = False


@contextmanager
def without_secrets(environ: MutableMapping[str, str]) -> Iterator[None]:
    """`environ` without SECRET_ENV_VARS for the duration (the processes started meanwhile
    inherit none of them), then restored."""
    saved = {name: environ.pop(name) for name in SECRET_ENV_VARS if name in environ}
    try:
        yield
    finally:
        environ.update(saved)
