"""Shared fixtures: one local Ray per test session, a fresh Redis server per deployment, one
torch thread for the model tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test cluster: no token files
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    if not ray.is_initialized():
        # "local": a fresh Ray of its own, whatever cluster `ray start` last recorded here (an
        # interrupted multi-node run leaves its dead head's address behind).
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield
    ray.shutdown()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The CI box has 2 cores shared with other suites; tiny matmuls gain nothing from more
    threads (model tests use it with `pytest.mark.usefixtures`)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
