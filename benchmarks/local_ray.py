"""How the CPU-cluster benchmarks start Ray: a fresh local instance of their own (never whatever
cluster `ray start` last recorded on the machine), quiet, without token auth unless asked for."""

from __future__ import annotations

import os


def start_local_ray(num_cpus: int | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
