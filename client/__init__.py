"""kvmesh.client: Python clients (sync and asyncio) for a kvmesh coordinator, and the CLI.

from kvmesh.client import Client
with Client("127.0.0.1:50051") as client:
    print(client.generate([1, 2, 3], max_tokens=8).tokens)
"""

from __future__ import annotations

from kvmesh.client.async_client import AsyncClient
from kvmesh.client.client import Client
from kvmesh.client.credentials import tls_credentials
from kvmesh.client.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    KVMeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SessionBusy,
    Unauthenticated,
    Unavailable,
)
from kvmesh.client.results import (
    CacheFacts,
    GenerateResult,
    IndexReport,
    LookupResult,
    RouteResult,
    Stats,
    StreamChunk,
    WorkerIndexView,
    WorkerInfo,
    WorkerMatch,
    WorkerScore,
)

__all__ = [
    "AsyncClient",
    "CacheFacts",
    "Client",
    "DeadlineExceeded",
    "GenerateResult",
    "IndexReport",
    "InternalError",
    "InvalidArgument",
    "KVMeshError",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SessionBusy",
    "RouteResult",
    "Stats",
    "StreamChunk",
    "Unauthenticated",
    "Unavailable",
    "tls_credentials",
    "WorkerIndexView",
    "WorkerInfo",
    "WorkerMatch",
    "WorkerScore",
]
