"""The gRPC face of the coordinator: with its gate (`interceptor.py`) and its server
(`grpc_server.py`), the only server-side modules that import grpc.

Every RPC maps the coordinator's exceptions to a status code and never lets one request's failure
stop the server:

    InvalidRequest / ValueError -> INVALID_ARGUMENT      NoLiveWorker / WorkerDied -> UNAVAILABLE
    RequestRejected (worker refused, or a request's own sampling failed) -> INVALID_ARGUMENT
    WorkerFailed (the worker failed the request), anything else -> INTERNAL
Oversized messages are refused by gRPC itself with RESOURCE_EXHAUSTED (max_receive_message_length).
Authentication, rate and stream limits, field sizes and unparsable bytes are answered before a
call gets here, by the interceptor (`service/interceptor.py`). Request messages become the
coordinator's inputs in `request_messages.py`; replies are built in `cache_messages.py` and
`worker_messages.py`; the server around the servicer is `grpc_server.py`. The admin RPCs (Drain,
ClearCache, VerifyIndex, IndexTree) delegate to `coordinator/service/admin.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

import grpc

from kvmesh.coordinator.contract import InvalidRequest, NoLiveWorker, WorkerDied
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.follower import IndexFollower
from kvmesh.coordinator.prompt_preparer import PreparedPrompt
from kvmesh.coordinator.service.admin import Admin, Fleet
from kvmesh.coordinator.service.cache_messages import (
    cache_facts_message,
    cache_stats_message,
    link_check_fields,
    tree_message,
)
from kvmesh.coordinator.service.detokenizer import IncrementalDetokenizer
from kvmesh.coordinator.service.interceptor import GateInterceptor
from kvmesh.coordinator.service.request_messages import (
    prepared_prompt,
    sampling_of,
    turn_mode_of,
)
from kvmesh.coordinator.service.worker_messages import (
    cache_totals,
    session_totals,
    workers_message,
)
from kvmesh.coordinator.session_turns import SessionBusy
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers.contract.replies import RequestRejected

log = logging.getLogger(__name__)
T = TypeVar("T")


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
                    resp.cache.CopyFrom(cache_facts_message(event, self.coordinator.policy.name))
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
        prompt = self._prepare(request)
        sampling = sampling_of(request)
        mode = turn_mode_of(request)
        return self.coordinator.generate(
            prompt,
            sampling,
            session_id=request.session_id,
            worker_id=request.worker_id,
            turn_mode=mode,
            label=label,
        )

    def _prepare(self, request: Any) -> PreparedPrompt:
        c = self.coordinator
        return prepared_prompt(c.prompts, c.config.max_prompt_tokens, request)

    def Route(self, request: pb.RouteRequest, context: grpc.ServicerContext) -> pb.RouteResponse:
        def run() -> pb.RouteResponse:
            c = self.coordinator
            prompt = self._prepare(request)
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
            prompt = self._prepare(request)
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
                **session_totals(self.cluster),
                **s,
                cache=cache_stats_message(cache_totals(self.cluster)),
                num_tree_nodes=self.follower.mirror.num_tree_nodes if self.follower else 0,
            )

        return self._guard(context, run)

    def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.ServicerContext
    ) -> pb.ListWorkersResponse:
        return self._guard(context, self._list_workers)

    def _list_workers(self) -> pb.ListWorkersResponse:
        return workers_message(self.cluster, self.coordinator.indexed_blocks_of, self.worker_kind)

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
