"""The asyncio Python client for a kvmesh coordinator: `Client`'s twin (`client.py`).

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate([1, 2, 3, 4], max_tokens=8)
        async for chunk in client.stream(prompt="Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)

Same arguments, same results (`kvmesh.client.results`), same errors
(`kvmesh.client.errors.KVMeshError` subclasses; `ValueError` before anything is sent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvmesh.client import wire
from kvmesh.client.channel_options import DEFAULT_MAX_MESSAGE_BYTES, auth_metadata, channel_options
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
        options = channel_options(address, timeout_s, max_message_bytes)
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(token)
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
        request = wire.build_generate_request(**wire.generate_kwargs(locals()))
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
        request = wire.build_generate_request(**wire.generate_kwargs(locals()))
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
