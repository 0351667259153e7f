"""The gRPC face of the coordinator: with its gate (`interceptor.py`), the only server-side
module that imports grpc.

Every RPC maps the coordinator's exceptions to a status code and never lets one request's failure
stop the server:

    InvalidRequest / ValueError -> INVALID_ARGUMENT      NoLiveWorker / WorkerDied -> UNAVAILABLE
    RequestRejected (worker refused, or a request's own sampling failed) -> INVALID_ARGUMENT
    WorkerFailed (the worker failed the request), anything else -> INTERNAL
Oversized messages are refused by gRPC itself with RESOURCE_EXHAUSTED (max_receive_message_length).
Authentication, rate and stream limits, field sizes and unparsable bytes are answered before a
call gets here, by the interceptor (`service/interceptor.py`). The admin RPCs (Drain, ClearCache,
VerifyIndex, IndexTree) delegate to `coordinator/service/admin.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.coordinator.contract import InvalidRequest, NoLiveWorker, WorkerDied
from kvmesh.coordinator.coordinator import Coordinator, StreamEvent
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.prompt_preparer import PreparedPrompt
from kvmesh.coordinator.service.admin import Admin, Fleet
from kvmesh.coordinator.service.cache_messages import (
    cache_stats_message,
    link_check_fields,
    tree_message,
)
from kvmesh.coordinator.service.detokenizer import IncrementalDetokenizer
from kvmesh.coordinator.service.interceptor import GateInterceptor
from kvmesh.coordinator.service.tls import ServerTls
from kvmesh.coordinator.session_turns import SessionBusy, TurnMode
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.proto.block_hash import MediaItem
from kvmesh.workers.contract.replies import CacheStats, RequestRejected
from kvmesh.workers.contract.requests import SamplingConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVICE_NAME = "kvmesh.v1.KVMesh"


_TURN_MODES = {
    pb.TURN_MODE_CONCURRENT: TurnMode.CONCURRENT,
    pb.TURN_MODE_REFUSE: TurnMode.REFUSE,
    pb.TURN_MODE_QUEUE: TurnMode.QUEUE,
}


def _status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, SessionBusy):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, InvalidRequest | RequestRejected | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NoLiveWorker | WorkerDied):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class KVMeshServicer(pb_grpc.KVMeshServicer):
    def __init__(
        self,
        coordinator: Coordinator,
        cluster: Fleet,
        follower: IndexFollower | None,
        *,
        admin: Admin | None = None,
        gate: GateInterceptor | None = None,
        worker_kind: Callable[[str], str] | None = None,
    ) -> None:
        self.worker_kind = worker_kind or (lambda _w: "kvmesh")
        """`kvmesh` for kvmesh's own workers, an external engine's kind (`vllm`, ...)."""
        self.coordinator = coordinator
        self.cluster = cluster
        self.follower = follower
        self.admin = admin
        self.gate = gate

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:
            code = _status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("internal error")
            context.abort(code, str(exc) or type(exc).__name__)
            raise  # unreachable: abort raises

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        started = time.perf_counter()
        # The client's id is a label it gets back (generated when absent); the coordinator keys
        # the request by its own id, so two clients sending the same label never collide.
        request_id = request.request_id or uuid.uuid4().hex
        stream = self._guard(context, lambda: self._start_generate(request, request_id))
        first = True
        tokenizer = self.coordinator.prompts.tokenizer
        detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        try:
            for event in stream:
                resp = pb.GenerateResponse(token_ids=event.token_ids, request_id=request_id)
                if detok is not None:
                    resp.text = detok.push(event.token_ids) + (
                        detok.flush() if event.finished else ""
                    )
                if first:
                    resp.ttft_ms = (time.perf_counter() - started) * 1e3
                    resp.cache.CopyFrom(self._cache_facts(event))
                    first = False
                if event.finished:
                    resp.finish_reason = event.finish_reason
                yield resp
        except Exception as exc:
            code = _status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("generate failed")
            context.abort(code, str(exc) or type(exc).__name__)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # a cancelled client: stop the worker now, count it as cancelled

    def _cache_facts(self, event: StreamEvent) -> pb.CacheFacts:
        facts = event.prefill
        if facts is None:  # the worker's stream ended before its first token
            return pb.CacheFacts(worker_id=event.worker_id, policy=self.coordinator.policy.name)
        return pb.CacheFacts(
            worker_id=event.worker_id,
            prompt_tokens=facts.prompt_tokens,
            cached_tokens=facts.local_tokens + facts.host_tokens,
            pulled_tokens=facts.pulled_tokens,
            computed_tokens=facts.computed_tokens,
            policy=self.coordinator.policy.name,
        )

    def _start_generate(self, request: pb.GenerateRequest, label: str) -> Iterator[Any]:
        try:
            return self._try_generate(request, label)
        except (InvalidRequest, RequestRejected, ValueError, NoLiveWorker) as exc:
            # Refused before any worker took it: its record (for metrics and the request log)
            # is made here; a request that reached a worker is recorded when its stream ends.
            outcome = "unavailable" if isinstance(exc, NoLiveWorker) else "invalid"
            self.coordinator.note_refused(label, outcome, str(exc) or type(exc).__name__)
            raise

    def _try_generate(self, request: pb.GenerateRequest, label: str) -> Iterator[Any]:
        c = self.coordinator
        prompt = self._prepare(request.token_ids, request.prompt, request.cache_salt, request)
        s = request.sampling
        if not request.HasField("sampling") or s.max_tokens == 0:
            raise InvalidRequest("sampling.max_tokens must be >= 1")
        sampling = SamplingConfig(  # raises ValueError (INVALID_ARGUMENT) outside the safe ranges
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=1.0 if s.top_p == 0 else s.top_p,  # proto3's default 0 means "not set"
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            min_p=s.min_p,
        )
        mode = _TURN_MODES.get(request.turn_mode)
        if mode is None:
            raise InvalidRequest(f"unknown turn_mode {request.turn_mode}")
        return c.generate(
            prompt,
            sampling,
            session_id=request.session_id,
            worker_id=request.worker_id,
            turn_mode=mode,
            label=label,
        )

    def _prepare(
        self, token_ids: Any, prompt: str, cache_salt: str, request: Any = None
    ) -> PreparedPrompt:
        """`PromptPreparer.prepare` within `max_prompt_tokens` (checked before hashing, and again
        after tokenizing a text prompt), with the request's adapter, media items and
        `bypass_cache` (Generate and Route have one)."""
        limit = self.coordinator.config.max_prompt_tokens
        prepared = None
        if not limit or len(token_ids) <= limit:
            adapter, media = adapter_and_media(request)
            prepared = self.coordinator.prompts.prepare(
                list(token_ids),
                prompt,
                cache_salt,
                adapter=adapter,
                media=media,
                bypass_cache=bool(getattr(request, "bypass_cache", False)),
            )
            if not limit or len(prepared.token_ids) <= limit:
                return prepared
        n = len(token_ids) if prepared is None else len(prepared.token_ids)
        raise InvalidRequest(
            f"prompt of {n} tokens is over this server's max_prompt_tokens {limit}"
        )

    def Route(self, request: pb.RouteRequest, context: grpc.ServicerContext) -> pb.RouteResponse:
        def run() -> pb.RouteResponse:
            c = self.coordinator
            prompt = self._prepare(request.token_ids, request.prompt, request.cache_salt, request)
            if request.max_tokens > c.config.max_tokens_limit:
                raise InvalidRequest(
                    f"max_tokens {request.max_tokens} is over the limit {c.config.max_tokens_limit}"
                )
            d = c.route(prompt, request.session_id, max_tokens=request.max_tokens or None)
            return pb.RouteResponse(
                worker_id=d.worker_id,
                prompt_tokens=len(prompt.token_ids),
                matched_tokens=d.matched_blocks * c.config.block_size,
                cost_ms=d.cost_ms,
                scores=[
                    pb.WorkerScore(
                        worker_id=s.worker_id, matched_blocks=s.matched_blocks, cost_ms=s.cost_ms
                    )
                    for s in d.scores
                ],
                policy=c.policy.name,
                session_worker_id=d.session_worker_id,
                session_affinity_ms=d.session_affinity_ms,
            )

        return self._guard(context, run)

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            c = self.coordinator
            prompt = self._prepare(request.token_ids, request.prompt, request.cache_salt, request)
            matches = c.fleet.match(prompt)
            bs = c.config.block_size
            return pb.LookupResponse(
                num_blocks=len(prompt.block_hashes),
                block_hashes=list(prompt.block_hashes),
                matches=[
                    pb.WorkerMatch(
                        worker_id=w, matched_blocks=m.num_blocks, matched_tokens=m.num_blocks * bs
                    )
                    for w, m in sorted(matches.items())
                ],
            )

        return self._guard(context, run)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        def run() -> pb.StatsResponse:
            c = self.coordinator
            s = c.stats()
            return pb.StatsResponse(
                num_workers=len(self.cluster.registry.known()),
                num_live_workers=len(self.cluster.registry.alive()),
                policy=c.policy.name,
                redis_connected=self.follower is not None and self.follower.connected,
                num_resyncs=self.follower.num_resyncs if self.follower is not None else 0,
                block_size=c.config.block_size,
                model=c.prompts.fingerprint,
                routing="cache_aware" if c.fleet.index_connected() else "load_only",
                num_decode_errors=self.follower.store.num_decode_errors if self.follower else 0,
                num_drained_workers=len(self.cluster.registry.drained()),
                num_rejected_requests=self.gate.num_rejected if self.gate else 0,
                num_slow_streams_cancelled=(
                    self.gate.num_slow_streams_cancelled if self.gate else 0
                ),
                num_pulls=c.transfers.num_pulls if c.transfers is not None else 0,
                num_failed_pulls=c.transfers.num_failed_pulls if c.transfers is not None else 0,
                **self._session_totals(),
                **s,
                cache=cache_stats_message(self._cache_totals()),
                num_tree_nodes=self.follower.mirror.num_tree_nodes if self.follower else 0,
            )

        return self._guard(context, run)

    def _cache_totals(self) -> CacheStats:
        """The workers' last cache reports, summed (so ListWorkers' figures add up to it)."""
        reports = [self.cluster.latest_info(w) for w in self.cluster.registry.known()]
        return CacheStats.total(i.cache for i in reports if i is not None)

    def _session_totals(self) -> dict[str, int]:
        """Warm-session counters summed over the workers' last reports (the health watcher's:
        Stats never waits on a worker)."""
        totals = dict.fromkeys(
            (
                "num_warm_sessions",
                "warm_session_bytes",
                "num_sessions_evicted_ttl",
                "num_sessions_evicted_budget",
                "num_sessions_evicted_pressure",
            ),
            0,
        )
        for w in self.cluster.registry.known():
            info = self.cluster.latest_info(w)
            if info is None:
                continue
            for name in totals:
                totals[name] += getattr(info.counters, name)
        return totals

    def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.ServicerContext
    ) -> pb.ListWorkersResponse:
        return self._guard(context, self._list_workers)

    def _list_workers(self) -> pb.ListWorkersResponse:
        infos = self.cluster.infos()
        registry = self.cluster.registry
        out = []
        for w in registry.known():
            i = infos.get(w) or self.cluster.latest_info(w)
            report: dict[str, Any] = {}
            if i is not None:
                report = {
                    "pid": i.pid,
                    "node": i.node,
                    "device": i.device,
                    "num_blocks": i.num_blocks,
                    "num_free_blocks": i.num_free_blocks,
                    "cached_tokens": i.counters.cached_tokens,
                    "computed_tokens": i.counters.computed_tokens,
                    "num_requests": i.counters.num_requests,
                    "num_running": i.num_running,
                    "num_waiting": i.num_waiting,
                    "generation": i.generation,
                    "num_warm_sessions": i.counters.num_warm_sessions,
                    "warm_session_bytes": i.counters.warm_session_bytes,
                    "cache": cache_stats_message(i.cache),
                    "adapters": list(i.adapters),
                }
            out.append(
                pb.WorkerInfo(
                    worker_id=w,
                    alive=registry.is_alive(w),
                    num_indexed_blocks=self.coordinator.indexed_blocks_of(w),
                    drained=registry.is_drained(w),
                    kind=self.worker_kind(w),
                    **report,
                )
            )
        return pb.ListWorkersResponse(workers=out)

    # ---- admin RPCs (admin token required when auth is on: see auth.py) ------------------------

    def _admin(self) -> Admin:
        if self.admin is None:
            raise InvalidRequest("this coordinator was started without admin operations")
        return self.admin

    def Scale(self, request: pb.ScaleRequest, context: grpc.ServicerContext) -> pb.ScaleResponse:
        def run() -> pb.ScaleResponse:
            timeout_s = request.drain_timeout_s or 600.0
            started, stopped = self._admin().scale(request.num_workers, timeout_s)
            return pb.ScaleResponse(
                started_worker_ids=started,
                stopped_worker_ids=stopped,
                num_workers=len(self.cluster.registry.alive()),
            )

        return self._guard(context, run)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        def run() -> pb.DrainResponse:
            drained = self._admin().drain(request.worker_id, undrain=request.undrain)
            return pb.DrainResponse(drained_worker_ids=drained)

        return self._guard(context, run)

    def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.ServicerContext
    ) -> pb.ClearCacheResponse:
        def run() -> pb.ClearCacheResponse:
            reset = self._admin().clear_cache()
            freed = sorted(reset.num_freed_blocks.items())
            cleared = [pb.WorkerCleared(worker_id=w, num_freed_blocks=n) for w, n in freed]
            return pb.ClearCacheResponse(workers=cleared, cache_epoch=reset.cache_epoch)

        return self._guard(context, run)

    def VerifyIndex(
        self, request: pb.VerifyIndexRequest, context: grpc.ServicerContext
    ) -> pb.VerifyIndexResponse:
        def run() -> pb.VerifyIndexResponse:
            admin = self._admin()
            views = [pb.WorkerIndexView(**asdict(v)) for v in admin.index_views()]
            connected = self.follower is not None and self.follower.connected
            links = link_check_fields(admin.check_links())
            return pb.VerifyIndexResponse(workers=views, redis_connected=connected, **links)

        return self._guard(context, run)

    def IndexTree(
        self, request: pb.IndexTreeRequest, context: grpc.ServicerContext
    ) -> pb.IndexTreeResponse:
        def run() -> pb.IndexTreeResponse:
            views, num_nodes = self._admin().tree(request.max_nodes, hottest=request.hottest)
            return tree_message(views, num_nodes, self.coordinator.config.block_size)

        return self._guard(context, run)


def adapter_and_media(request: Any) -> tuple[str, tuple[MediaItem, ...]]:
    """The adapter name and media items of a Generate / Route / Lookup request (none: base)."""
    if request is None:
        return "", ()
    media = tuple(MediaItem(m.hash, m.offset, m.length) for m in request.media)
    return request.adapter, media


def build_server(
    servicer: KVMeshServicer,
    host: str,
    port: int,
    *,
    max_message_bytes: int,
    max_workers: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTls | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A configured, not yet started server with health checking and reflection, and its port.
    With `tls` the port speaks TLS only (and requires client certificates if it has a CA)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvmesh-rpc"),
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=max_workers,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A port another server holds is an error, not a second listener sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_KVMeshServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["KVMesh"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.private_key, tls.certificate_chain)],
            root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    set_serving(health_servicer, True)
    return server, bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    """The health answer for the service and the server as a whole."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, status)
