"""Typed client errors, mapped from gRPC status codes.

Users catch these instead of `grpc.RpcError`, so code that calls kvmesh never has to know which
transport carried the call. Every error keeps the status code's name (`code`) and the server's
message (`details`); the class says what the caller can do about it:

    InvalidArgument     fix the request (bad tokens, sampling out of range, prompt too long)
    Unavailable         retry later or elsewhere (coordinator down, no live worker)
    ResourceExhausted   back off (server at capacity, message too large)
    NotFound            the named worker or request does not exist
    Unauthenticated     send credentials
    PermissionDenied    the credentials may not do this
    DeadlineExceeded    the call ran past its timeout
    SessionBusy         wait for the session's turn in flight (FAILED_PRECONDITION)
    InternalError       a server bug or lost data; report it
    KVMeshError         anything else (CANCELLED, UNIMPLEMENTED, ABORTED, ...)
"""

from __future__ import annotations

import grpc


class KVMeshError(Exception):
    """A failed kvmesh call: `code` is the gRPC status name, `details` the server's message."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


class InvalidArgument(KVMeshError):
    """The request was rejected as malformed or out of range (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class Unavailable(KVMeshError):
    """The coordinator could not be reached, or it has no live worker to serve the request."""

    @property
    def is_connection_failure(self) -> bool:
        """True when the client never reached a server, as opposed to a server saying "busy".

        gRPC reports both as UNAVAILABLE; only the client library's own message tells them apart.
        """
        text = self.details.lower()
        return any(marker in text for marker in _CONNECTION_FAILURE_MARKERS)


class ResourceExhausted(KVMeshError):
    """The server is at capacity, or a message exceeded its size limit."""


class NotFound(KVMeshError):
    """The named worker, request or resource does not exist."""


class Unauthenticated(KVMeshError):
    """The call carried no valid credentials."""


class PermissionDenied(KVMeshError):
    """The credentials are valid but may not perform this call."""


class DeadlineExceeded(KVMeshError):
    """The call did not finish within its timeout."""


class SessionBusy(KVMeshError):
    """Another turn of the session is in flight and this turn asked to run alone
    (FAILED_PRECONDITION)."""


class InternalError(KVMeshError):
    """The server failed unexpectedly (INTERNAL, UNKNOWN, DATA_LOSS)."""


# Phrases grpc-core puts in UNAVAILABLE errors it raises itself, before any server answered.
_CONNECTION_FAILURE_MARKERS = (
    "failed to connect",
    "connection refused",
    "dns resolution failed",
    "errors resolving",
    "name resolution",
    "connection reset",
    "socket closed",
    "no route to host",
)

_CODE_TO_ERROR: dict[grpc.StatusCode, type[KVMeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: SessionBusy,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def error_class_for(code: grpc.StatusCode) -> type[KVMeshError]:
    """The error class a status code maps to; unlisted codes map to the `KVMeshError` base."""
    return _CODE_TO_ERROR.get(code, KVMeshError)


def from_rpc_error(err: grpc.RpcError) -> KVMeshError:
    """Convert a failed gRPC call (sync or asyncio) into the matching typed error.

    A bare `grpc.RpcError` carries no status; it becomes an `InternalError` with code UNKNOWN.
    """
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    text = " ".join(str(details).split()) if details else ""
    return error_class_for(code)(code.name, text)
