"""The blocking Python client for a kvmesh coordinator (`AsyncClient` is its asyncio twin).

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

import time
from collections.abc import Iterator, Sequence

import grpc

from kvmesh.client import wire
from kvmesh.client.channel_options import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.client.errors import DeadlineExceeded
from kvmesh.client.failover_channels import FailoverChannels
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
from kvmesh.proto.block_hash import MediaItem


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
        self.channels = FailoverChannels(
            [address] if isinstance(address, str) else list(address),
            timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
            credentials=credentials,
            token=token,
        )
        """Where calls go, and how they fail over (`failover_channels.py`)."""
        self.timeout_s = timeout_s
        self.last_cache_epoch = 0
        """The cache epoch the last `clear_cache` moved the fleet to."""

    @property
    def address(self) -> str:
        """The coordinator calls go to now."""
        return self.channels.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels; calls in flight are cancelled. Closing twice is harmless."""
        self.channels.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the coordinator accepts connections; DeadlineExceeded after `timeout_s`."""
        try:
            grpc.channel_ready_future(self.channels.channel).result(timeout=timeout_s)
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
        request = wire.build_generate_request(**wire.generate_kwargs(locals()))
        start_s = time.perf_counter()
        accumulator = StreamAccumulator(start_s)
        for chunk in self.channels.chunks(request):
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
        request = wire.build_generate_request(**wire.generate_kwargs(locals()))
        return self.channels.chunks(request)

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
        return wire.route_from_proto(self.channels.unary("Route", request))

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
        return wire.lookup_from_proto(self.channels.unary("Lookup", request))

    def stats(self) -> Stats:
        return wire.stats_from_proto(self.channels.unary("Stats", pb.StatsRequest()))

    def list_workers(self) -> list[WorkerInfo]:
        return wire.workers_from_proto(self.channels.unary("ListWorkers", pb.ListWorkersRequest()))

    # Admin calls: with auth on, the client's token must be an admin token.

    def drain(self, worker_id: str, *, undrain: bool = False) -> list[str]:
        """Stop routing new requests to `worker_id` (its running streams finish), or route to it
        again with `undrain=True`; returns every drained worker."""
        request = pb.DrainRequest(worker_id=worker_id, undrain=undrain)
        return list(self.channels.unary("Drain", request).drained_worker_ids)

    def scale(self, num_workers: int, *, drain_timeout_s: float = 0.0) -> ScaleResult:
        """Grow or shrink the fleet to `num_workers`; leaving workers finish their streams first
        (at most `drain_timeout_s`, 0: the server's 600 s)."""
        request = pb.ScaleRequest(num_workers=num_workers, drain_timeout_s=drain_timeout_s)
        return wire.scale_from_proto(self.channels.unary("Scale", request))

    def clear_cache(self) -> dict[str, int]:
        """Reset the cache: every worker drops its cached (unreferenced) blocks and the fleet
        moves to a new cache epoch (then in `last_cache_epoch`), so nothing computed before can
        be matched; returns blocks freed per worker."""
        response = self.channels.unary("ClearCache", pb.ClearCacheRequest())
        self.last_cache_epoch = response.cache_epoch
        return {w.worker_id: w.num_freed_blocks for w in response.workers}

    def index_tree(self, *, max_nodes: int = 0, hottest: bool = False) -> IndexTree:
        """The coordinator's prefix tree (`kvmesh index tree`), or its most hit nodes."""
        request = pb.IndexTreeRequest(max_nodes=max_nodes, hottest=hottest)
        return wire.index_tree_from_proto(self.channels.unary("IndexTree", request))

    def index_views(self) -> IndexReport:
        """Per worker, the coordinator's index mirror and the worker's pool (`kvmesh index
        verify` compares them, and Redis)."""
        return wire.index_report_from_proto(
            self.channels.unary("VerifyIndex", pb.VerifyIndexRequest())
        )
