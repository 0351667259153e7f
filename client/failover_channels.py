"""The blocking client's channels: one per coordinator address of one fleet, failing over.

A call that finds its coordinator unavailable (UNAVAILABLE before any response) moves on to the
next address (`AddressRing`), so a killed coordinator costs a retry, not an error. A stream
already answering is not moved (that could repeat tokens); it fails as it would with one address.

A stream is read on the thread that iterates it. By default gRPC hands each response over from
a polling thread it starts per channel whenever a call begins while none is running, so a
client making one call at a time started a thread per `Generate` and waited on a second handoff
for every response (0.1-0.2 ms of each first chunk on the CPU box; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import grpc.experimental

from kvmesh.client import wire
from kvmesh.client.address_ring import AddressRing
from kvmesh.client.channel_options import auth_metadata, channel_options
from kvmesh.client.errors import from_rpc_error
from kvmesh.client.results import StreamChunk
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

STREAM_OPTIONS = (
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    # Connections are otherwise shared process-wide by target and options, and with streams read
    # this way a closed channel's connection to a dead coordinator can outlive it, reconnect
    # backoff included: a new client of the restarted coordinator then failed at once with the
    # old "connection refused". Each channel connects on its own.
    ("grpc.use_local_subchannel_pool", 1),
)
"""Options of every channel, besides `channel_options`."""


class FailoverChannels:
    """Thread-safe: one gRPC channel per address, shared by all calls.

    Invariant: `channels` and `stubs` are in `ring.addresses` order, one each.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        timeout_s: float | None,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None,
        token: str | None,
    ) -> None:
        self.ring = AddressRing(list(addresses))
        self.timeout_s = timeout_s
        self.metadata = auth_metadata(token)
        self.channels: list[grpc.Channel] = []
        for a in self.ring.addresses:
            options = [*channel_options(a, timeout_s, max_message_bytes), *STREAM_OPTIONS]
            if credentials is None:
                self.channels.append(grpc.insecure_channel(a, options=options))
            else:
                self.channels.append(grpc.secure_channel(a, credentials, options=options))
        self.stubs = [pb_grpc.KVMeshStub(c) for c in self.channels]

    @property
    def address(self) -> str:
        """The coordinator calls go to now."""
        return self.ring.current

    @property
    def channel(self) -> grpc.Channel:
        return self.channels[self.ring.index]

    def close(self) -> None:
        """Close the channels; calls in flight are cancelled. Closing twice is harmless."""
        for channel in self.channels:
            channel.close()

    def unary(self, name: str, request: Any) -> Any:
        """Call the RPC `name` on the current coordinator, failing over (see the module)."""
        for attempt in range(len(self.ring.addresses)):
            call = getattr(self.stubs[self.ring.index], name)
            try:
                return call(request, timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if not self._fail_over(err, attempt):
                    raise from_rpc_error(err) from err
        raise AssertionError("unreachable: the last attempt raises")

    def chunks(self, request: pb.GenerateRequest) -> Iterator[StreamChunk]:
        """`Generate`'s stream, failing over until its first response."""
        for attempt in range(len(self.ring.addresses)):
            stub = self.stubs[self.ring.index]
            call = stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)
            answered = False
            try:
                for response in call:
                    answered = True
                    yield wire.chunk_from_proto(response)
                return
            except grpc.RpcError as err:
                if answered or not self._fail_over(err, attempt):
                    raise from_rpc_error(err) from err
            finally:
                call.cancel()  # a no-op once the stream has ended; frees the server if abandoned

    def _fail_over(self, err: grpc.RpcError, attempt: int) -> bool:
        """Move to the next address after an UNAVAILABLE, unless every one was tried."""
        code = err.code() if hasattr(err, "code") else None
        if code is not grpc.StatusCode.UNAVAILABLE or attempt + 1 >= len(self.ring.addresses):
            return False
        self.ring.advance()
        return True
