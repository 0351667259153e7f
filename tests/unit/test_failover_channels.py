"""A client given several coordinator addresses moves past one that is down, for unary calls
and for a stream that has not answered yet (`client/failover_channels.py`), over real gRPC."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvmesh.client.errors import Unavailable
from kvmesh.client.failover_channels import FailoverChannels
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from tests.unit.test_cli import FakeKVMesh


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVMeshServicer_to_server(FakeKVMesh(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def down() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def channels(*addresses: str) -> FailoverChannels:
    return FailoverChannels(
        addresses, timeout_s=10, max_message_bytes=1 << 20, credentials=None, token=None
    )


def test_a_unary_call_moves_past_an_address_that_is_down(address: str, down: str) -> None:
    c = channels(down, address)
    try:
        assert c.unary("Stats", pb.StatsRequest()).num_workers == 2
        assert c.address == address  # later calls start where the last one succeeded
    finally:
        c.close()


def test_a_stream_moves_past_an_address_that_is_down(address: str, down: str) -> None:
    c = channels(down, address)
    request = pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2))
    try:
        assert [chunk.token_ids for chunk in c.chunks(request)] == [[], [10], [11]]
    finally:
        c.close()


def test_when_every_address_is_down_the_last_error_is_raised(down: str) -> None:
    c = channels(down, down)
    try:
        with pytest.raises(Unavailable):
            c.unary("Stats", pb.StatsRequest())
    finally:
        c.close()
