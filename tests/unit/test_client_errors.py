"""Mapping gRPC status codes to the client's typed errors."""

from __future__ import annotations

import socket

import grpc
import pytest

from kvmesh.client.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    KVMeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)


class FakeRpcError(grpc.RpcError):
    """Stands in for grpc's call errors, which expose the status through code()/details()."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__()
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


@pytest.mark.parametrize(
    ("code", "error_class"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidArgument),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.UNKNOWN, InternalError),
        (grpc.StatusCode.DATA_LOSS, InternalError),
    ],
)
def test_status_code_maps_to_its_error_class(
    code: grpc.StatusCode, error_class: type[KVMeshError]
) -> None:
    error = from_rpc_error(FakeRpcError(code, "what went wrong"))
    assert type(error) is error_class
    assert error.code == code.name
    assert error.details == "what went wrong"
    assert str(error) == f"{code.name}: what went wrong"


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ABORTED],
)
def test_unlisted_codes_become_the_base_error(code: grpc.StatusCode) -> None:
    error = from_rpc_error(FakeRpcError(code, "x"))
    assert type(error) is KVMeshError
    assert error.code == code.name


def test_every_typed_error_is_a_kvmesh_error() -> None:
    for cls in (InvalidArgument, Unavailable, ResourceExhausted, NotFound, Unauthenticated):
        assert issubclass(cls, KVMeshError)
    for cls in (PermissionDenied, DeadlineExceeded, InternalError):
        assert issubclass(cls, KVMeshError)


def test_bare_rpc_error_without_status_is_an_internal_unknown() -> None:
    error = from_rpc_error(grpc.RpcError())
    assert isinstance(error, InternalError)
    assert error.code == "UNKNOWN"
    assert error.details == ""
    assert str(error) == "UNKNOWN"


def test_multiline_details_are_flattened_to_one_line() -> None:
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "first\n  second\tthird\n"))
    assert error.details == "first second third"


def test_missing_details_become_empty() -> None:
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, None))
    assert error.details == ""


@pytest.mark.parametrize(
    ("details", "is_connection_failure"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
            "Failed to connect to remote host: Connection refused",
            True,
        ),
        ("DNS resolution failed for nohost:50051", True),
        ("errors resolving nohost.invalid:50051: Domain name not found", True),
        ("no live worker can serve this request", False),
    ],
)
def test_unavailable_tells_connection_failures_from_busy_servers(
    details: str, is_connection_failure: bool
) -> None:
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, details))
    assert isinstance(error, Unavailable)
    assert error.is_connection_failure is is_connection_failure


def test_real_refused_connection_is_a_connection_failure(closed_port: int) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{closed_port}")
    method = channel.unary_unary("/kvmesh.v1.KVMesh/Stats")
    try:
        with pytest.raises(grpc.RpcError) as raised:
            method(b"", timeout=5.0)
    finally:
        channel.close()
    error = from_rpc_error(raised.value)
    assert isinstance(error, Unavailable)
    assert error.is_connection_failure


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
