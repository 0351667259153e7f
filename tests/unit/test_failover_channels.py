"""A client given several coordinator addresses moves past one that is down, for unary calls
and for a stream that has not answered yet (`client/failover_channels.py`), over real gRPC."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvmesh.client.errors import Unavailable
from kvmesh.client.failover_channels import FailoverChannels
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from tests.unit import test_cli

# The fake coordinator's server and a closed port: the CLI tests' fixtures.
address = test_cli.address
closed_port = test_cli.closed_port


@pytest.fixture
def down(closed_port: int) -> str:
    return f"127.0.0.1:{closed_port}"


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


def test_a_stream_is_read_on_the_calling_thread(address: str) -> None:
    c = channels(address)
    request = pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2))
    try:
        before = set(threading.enumerate())
        started = []  # besides the fake server's own pool threads
        for _chunk in c.chunks(request):
            started += [
                t.name
                for t in set(threading.enumerate()) - before
                if not t.name.startswith("ThreadPoolExecutor")
            ]
        assert started == []  # no polling thread handed the responses over
    finally:
        c.close()


def serve_fake(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVMeshServicer_to_server(test_cli.FakeKVMesh(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def test_new_channels_to_a_restarted_coordinator_connect_at_once(closed_port: int) -> None:
    """Channels closed while their coordinator was down leave no reconnect backoff behind for
    the next ones to the same address."""
    address = f"127.0.0.1:{closed_port}"
    request = pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2))
    server = serve_fake(closed_port)
    first = channels(address)
    try:
        assert len(list(first.chunks(request))) == 3
        server.stop(grace=None).wait()
        for _ in range(3):
            with pytest.raises(Unavailable):
                list(first.chunks(request))
    finally:
        first.close()
    server = serve_fake(closed_port)
    second = channels(address)
    try:
        assert second.unary("Stats", pb.StatsRequest()).num_workers == 2
    finally:
        second.close()
        server.stop(grace=None)


class EndlessStream(pb_grpc.KVMeshServicer):
    """Answers one chunk, then keeps the stream open until its client goes away."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator:
        context.add_callback(self.ended.set)
        yield pb.GenerateResponse(token_ids=[10])
        while context.is_active():
            self.ended.wait(0.01)


def test_an_abandoned_stream_ends_its_call_on_the_server() -> None:
    servicer = EndlessStream()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVMeshServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c = channels(f"127.0.0.1:{port}")
    request = pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=9))
    try:
        stream = c.chunks(request)
        assert next(stream).token_ids == [10]
        stream.close()  # the caller went away
        assert servicer.ended.wait(timeout=10)
    finally:
        c.close()
        server.stop(grace=None)
