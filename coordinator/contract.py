"""The coordinator's contract with what surrounds it: the protocols through which it reaches
workers (`WorkerBackend`) and reads the index (`PrefixIndex`), and the errors of its request
path (the service maps them to status codes)."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from kvmesh.coordinator.index.mirror import FleetMatch, PrefixMatch, WorkerId
from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import WorkerRequest


class InvalidRequest(ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT)."""


class NoLiveWorker(RuntimeError):
    """No worker can take the request (maps to UNAVAILABLE)."""


class WorkerDied(RuntimeError):
    """The worker's actor died during a call (maps to UNAVAILABLE when it cannot be migrated)."""


class WorkerBackend(Protocol):
    """How the coordinator reaches a worker: the Ray shell, simulated workers, a test fake.
    `generate` raises `WorkerDied` when the worker is gone, `RequestRejected` for bad input."""

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]: ...

    def send(self, worker_id: str, request: WorkerRequest) -> Generator[RequestOutput, None, None]:
        """Like `generate`, but the request is on its way to the worker when this returns
        (speculative dispatch: the coordinator commits its decision meanwhile). Closing the
        returned iterator, read or not, aborts the request; nothing it produced is read."""
        ...


class PrefixIndex(Protocol):
    """What the coordinator reads of the index: the live system's `LockedMirror`; in the
    simulator's oracle, one shared pool."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_events_applied(self) -> int: ...
    def match(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]: ...
    def match_fleet(
        self,
        hashes: Sequence[BlockHash],
        row_of: Mapping[WorkerId, int],
        num_rows: int,
        hash_array: np.ndarray | None = None,
    ) -> FleetMatch: ...
    def num_worker_blocks(self, worker: WorkerId) -> int: ...
