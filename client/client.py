"""Python clients for a kvmesh coordinator: `Client` (blocking) and `AsyncClient` (asyncio).

Both speak the `kvmesh.v1.KVMesh` gRPC service and share one API:

    with Client("127.0.0.1:50051") as client:
        result = client.generate([1, 2, 3, 4], max_tokens=8)
        print(result.tokens, result.cached_tokens, result.worker_id)
        for chunk in client.stream(prompt="Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)

Every failed call raises a `kvmesh.client.errors.KVMeshError` subclass; a malformed argument raises
`ValueError` before anything is sent. Results are frozen dataclasses (`kvmesh.client.results`).
`token` is sent as `authorization: Bearer <token>` on every call (servers with auth on need it;
admin calls need an admin token); `credentials` (see `kvmesh.client.credentials`) switch to TLS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from kvmesh.client import wire
from kvmesh.client.address_ring import AddressRing
from kvmesh.client.errors import DeadlineExceeded, from_rpc_error
from kvmesh.client.results import (
    GenerateResult,
    IndexReport,
    IndexTree,
    LookupResult,
    RouteResult,
    ScaleResult,
    Stats,
    StreamChunk,
    WorkerInfo,
)
from kvmesh.client.stream_accumulator import StreamAccumulator
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.proto.block_hash import MediaItem

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    if token is None:
        return ()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("token must be non-empty printable text without spaces")
    return (("authorization", f"Bearer {token}"),)


def _channel_options(
    address: str, timeout_s: float | None, max_message_bytes: int
) -> list[tuple[str, int]]:
    """gRPC channel options after checking the constructor's arguments."""
    if not address or address != address.strip():
        raise ValueError(f"address must be a non-empty HOST:PORT, got {address!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class Client:
    """A blocking client; thread-safe (one gRPC channel per address, shared by all calls).

    `address` is one coordinator or several replicas of one fleet: a call that finds its
    coordinator unavailable (UNAVAILABLE before any response) moves on to the next address, so
    a killed coordinator costs a retry, not an error. A stream already answering is not moved
    (that could repeat tokens); it fails as it would with one address.
    `timeout_s` bounds every call, a whole `generate` stream included; None waits forever.
    `credentials` switches to TLS channels (grpc.ssl_channel_credentials(...)).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        self.ring = AddressRing([address] if isinstance(address, str) else list(address))
        self.timeout_s = timeout_s
        self._metadata = _auth_metadata(token)
        self.last_cache_epoch = 0
        """The cache epoch the last `clear_cache` moved the fleet to."""
        self._channels = []
        for a in self.ring.addresses:
            options = _channel_options(a, timeout_s, max_message_bytes)
            if credentials is None:
                self._channels.append(grpc.insecure_channel(a, options=options))
            else:
                self._channels.append(grpc.secure_channel(a, credentials, options=options))
        self._stubs = [pb_grpc.KVMeshStub(c) for c in self._channels]

    @property
    def address(self) -> str:
        """The coordinator calls go to now."""
        return self.ring.current

    @property
    def _channel(self) -> grpc.Channel:
        return self._channels[self.ring.index]

    @property
    def _stub(self) -> pb_grpc.KVMeshStub:
        return self._stubs[self.ring.index]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels; calls in flight are cancelled. Closing twice is harmless."""
        for channel in self._channels:
            channel.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the coordinator accepts connections; DeadlineExceeded after `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise DeadlineExceeded(
                "DEADLINE_EXCEEDED", f"{self.address} not ready after {timeout_s} s"
            ) from None

    def generate(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        session_id: str = "",
        turn_mode: str = "concurrent",
        cache_salt: str = "",
        worker_id: str = "",
        request_id: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> GenerateResult:
        """Generate from a prompt (token ids or text, exactly one) and wait for the whole stream.

        `temperature == 0` is greedy, else in [0.01, 100]; `top_p` 1, `top_k` 0 and `min_p` 0
        disable those filters; `seed` makes sampling reproducible. `worker_id` forces placement
        (empty: let the router choose). `turn_mode` ("concurrent", "refuse", "queue"): with a
        `session_id`, refuse (`SessionBusy`) or wait while another turn of it is in flight.
        `bypass_cache` reuses no cached KV and leaves none behind (routed by load only).
        """
        request = wire.build_generate_request(**_generate_kwargs(locals()))
        start_s = time.perf_counter()
        accumulator = StreamAccumulator(start_s)
        for chunk in self._chunks(request):
            accumulator.add(chunk, time.perf_counter())
        return accumulator.result(time.perf_counter())

    def stream(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        session_id: str = "",
        turn_mode: str = "concurrent",
        cache_salt: str = "",
        worker_id: str = "",
        request_id: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> Iterator[StreamChunk]:
        """Like `generate`, but yield each chunk as it arrives. Arguments are checked at once;
        abandoning the iterator (break, close()) cancels the request on the server."""
        request = wire.build_generate_request(**_generate_kwargs(locals()))
        return self._chunks(request)

    def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        session_id: str = "",
        cache_salt: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
        max_tokens: int | None = None,
    ) -> RouteResult:
        """The worker the router would choose for this prompt, without running it; `max_tokens`
        (what the request would generate) prices its decode load as `generate` would."""
        request = wire.build_route_request(
            token_ids,
            prompt=prompt,
            session_id=session_id,
            cache_salt=cache_salt,
            bypass_cache=bypass_cache,
            adapter=adapter,
            media=media,
            max_tokens=max_tokens,
        )
        return wire.route_from_proto(self._unary("Route", request))

    def lookup(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str = "",
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> LookupResult:
        """The prompt's block hashes and how many leading blocks each worker holds."""
        request = wire.build_lookup_request(
            token_ids, prompt=prompt, cache_salt=cache_salt, adapter=adapter, media=media
        )
        return wire.lookup_from_proto(self._unary("Lookup", request))

    def stats(self) -> Stats:
        return wire.stats_from_proto(self._unary("Stats", pb.StatsRequest()))

    def list_workers(self) -> list[WorkerInfo]:
        return wire.workers_from_proto(self._unary("ListWorkers", pb.ListWorkersRequest()))

    # Admin calls: with auth on, the client's token must be an admin token.

    def drain(self, worker_id: str, *, undrain: bool = False) -> list[str]:
        """Stop routing new requests to `worker_id` (its running streams finish), or route to it
        again with `undrain=True`; returns every drained worker."""
        request = pb.DrainRequest(worker_id=worker_id, undrain=undrain)
        return list(self._unary("Drain", request).drained_worker_ids)

    def scale(self, num_workers: int, *, drain_timeout_s: float = 0.0) -> ScaleResult:
        """Grow or shrink the fleet to `num_workers`; leaving workers finish their streams first
        (at most `drain_timeout_s`, 0: the server's 600 s)."""
        request = pb.ScaleRequest(num_workers=num_workers, drain_timeout_s=drain_timeout_s)
        return wire.scale_from_proto(self._unary("Scale", request))

    def clear_cache(self) -> dict[str, int]:
        """Reset the cache: every worker drops its cached (unreferenced) blocks and the fleet
        moves to a new cache epoch (then in `last_cache_epoch`), so nothing computed before can
        be matched; returns blocks freed per worker."""
        response = self._unary("ClearCache", pb.ClearCacheRequest())
        self.last_cache_epoch = response.cache_epoch
        return {w.worker_id: w.num_freed_blocks for w in response.workers}

    def index_tree(self, *, max_nodes: int = 0, hottest: bool = False) -> IndexTree:
        """The coordinator's prefix tree (`kvmesh index tree`), or its most hit nodes."""
        request = pb.IndexTreeRequest(max_nodes=max_nodes, hottest=hottest)
        return wire.index_tree_from_proto(self._unary("IndexTree", request))

    def index_views(self) -> IndexReport:
        """Per worker, the coordinator's index mirror and the worker's pool (`kvmesh index
        verify` compares them, and Redis)."""
        return wire.index_report_from_proto(self._unary("VerifyIndex", pb.VerifyIndexRequest()))

    def _unary(self, name: str, request: Any) -> Any:
        """Call the RPC `name` on the current coordinator (failing over, see the class)."""
        for attempt in range(len(self.ring.addresses)):
            call = getattr(self._stub, name)
            try:
                return call(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                if not self._fail_over(err, attempt):
                    raise from_rpc_error(err) from err
        raise AssertionError("unreachable: the last attempt raises")

    def _chunks(self, request: pb.GenerateRequest) -> Iterator[StreamChunk]:
        for attempt in range(len(self.ring.addresses)):
            call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
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


class AsyncClient:
    """The asyncio twin of `Client`: same arguments, same results, awaitable methods.

    Create it inside the running event loop that will use it (grpc.aio binds to that loop).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        options = _channel_options(address, timeout_s, max_message_bytes)
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = _auth_metadata(token)
        self.last_cache_epoch = 0
        """The cache epoch the last `clear_cache` moved the fleet to."""
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._stub = pb_grpc.KVMeshStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the coordinator accepts connections; DeadlineExceeded after `timeout_s`."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                "DEADLINE_EXCEEDED", f"{self.address} not ready after {timeout_s} s"
            ) from None

    async def generate(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        session_id: str = "",
        turn_mode: str = "concurrent",
        cache_salt: str = "",
        worker_id: str = "",
        request_id: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> GenerateResult:
        """See `Client.generate`."""
        request = wire.build_generate_request(**_generate_kwargs(locals()))
        start_s = time.perf_counter()
        accumulator = StreamAccumulator(start_s)
        async for chunk in self._chunks(request):
            accumulator.add(chunk, time.perf_counter())
        return accumulator.result(time.perf_counter())

    def stream(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        session_id: str = "",
        turn_mode: str = "concurrent",
        cache_salt: str = "",
        worker_id: str = "",
        request_id: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[StreamChunk]:
        """See `Client.stream`; use with `async for`. Arguments are checked at once."""
        request = wire.build_generate_request(**_generate_kwargs(locals()))
        return self._chunks(request)

    async def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        session_id: str = "",
        cache_salt: str = "",
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
        max_tokens: int | None = None,
    ) -> RouteResult:
        request = wire.build_route_request(
            token_ids,
            prompt=prompt,
            session_id=session_id,
            cache_salt=cache_salt,
            bypass_cache=bypass_cache,
            adapter=adapter,
            media=media,
            max_tokens=max_tokens,
        )
        return wire.route_from_proto(await self._unary(self._stub.Route, request))

    async def lookup(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str = "",
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> LookupResult:
        request = wire.build_lookup_request(
            token_ids, prompt=prompt, cache_salt=cache_salt, adapter=adapter, media=media
        )
        return wire.lookup_from_proto(await self._unary(self._stub.Lookup, request))

    async def stats(self) -> Stats:
        return wire.stats_from_proto(await self._unary(self._stub.Stats, pb.StatsRequest()))

    async def list_workers(self) -> list[WorkerInfo]:
        response = await self._unary(self._stub.ListWorkers, pb.ListWorkersRequest())
        return wire.workers_from_proto(response)

    async def drain(self, worker_id: str, *, undrain: bool = False) -> list[str]:
        request = pb.DrainRequest(worker_id=worker_id, undrain=undrain)
        return list((await self._unary(self._stub.Drain, request)).drained_worker_ids)

    async def scale(self, num_workers: int, *, drain_timeout_s: float = 0.0) -> ScaleResult:
        request = pb.ScaleRequest(num_workers=num_workers, drain_timeout_s=drain_timeout_s)
        return wire.scale_from_proto(await self._unary(self._stub.Scale, request))

    async def clear_cache(self) -> dict[str, int]:
        response = await self._unary(self._stub.ClearCache, pb.ClearCacheRequest())
        self.last_cache_epoch = response.cache_epoch
        return {w.worker_id: w.num_freed_blocks for w in response.workers}

    async def index_tree(self, *, max_nodes: int = 0, hottest: bool = False) -> IndexTree:
        request = pb.IndexTreeRequest(max_nodes=max_nodes, hottest=hottest)
        return wire.index_tree_from_proto(await self._unary(self._stub.IndexTree, request))

    async def index_views(self) -> IndexReport:
        response = await self._unary(self._stub.VerifyIndex, pb.VerifyIndexRequest())
        return wire.index_report_from_proto(response)

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err

    async def _chunks(self, request: pb.GenerateRequest) -> AsyncIterator[StreamChunk]:
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield wire.chunk_from_proto(response)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        finally:
            call.cancel()


def _generate_kwargs(call_locals: dict[str, Any]) -> dict[str, Any]:
    """The `generate`/`stream` arguments out of that method's locals(), minus `self`.

    The four generate-shaped methods keep explicit signatures (for users and type checkers) and
    forward them here in one line each, so adding a parameter cannot miss one of them.
    """
    return {k: v for k, v in call_locals.items() if k != "self"}
