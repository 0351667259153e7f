"""The gRPC server's gate: authentication, per-client rate, concurrent streams, malformed bytes.

A thin gRPC shell around the pure policies in `auth.py` and `limits.py` (the one other coordinator
module that imports grpc besides `service.py`: interceptors are a gRPC type). Every call of the
KVMesh service passes, in this order:

    authorization metadata  -> UNAUTHENTICATED / PERMISSION_DENIED     (auth.Authenticator)
    client's token bucket   -> RESOURCE_EXHAUSTED                      (limits.RateLimiter)
    request bytes           -> INVALID_ARGUMENT if they do not parse   (instead of gRPC's INTERNAL)
    a free stream slot      -> RESOURCE_EXHAUSTED (streaming calls)    (limits.StreamSlots)

Health checks skip the gate. Nothing here logs metadata, so a token never reaches a log line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.service.auth import OPEN_METHOD_PREFIXES, Authenticator, Verdict, client_key
from kvmesh.coordinator.service.limits import RateLimiter, StreamSlots

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/kvmesh.v1.KVMesh/"
_MALFORMED = object()  # what a request that did not parse deserializes to
_VERDICT_STATUS = {
    Verdict.UNAUTHENTICATED: (
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or unknown bearer token (send `authorization: Bearer <token>`)",
    ),
    Verdict.PERMISSION_DENIED: (
        grpc.StatusCode.PERMISSION_DENIED,
        "this call needs an admin token",
    ),
}


class GateInterceptor(grpc.ServerInterceptor):
    """Counts refusals in `num_rejected` (reported by `Stats`)."""

    def __init__(
        self,
        auth: Authenticator,
        rate: RateLimiter | None = None,
        streams: StreamSlots | None = None,
    ) -> None:
        self.auth = auth
        self.rate = rate
        self.streams = streams
        self.num_rejected = 0
        self._lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: Any, method: str) -> grpc.RpcMethodHandler:
        parse = _tolerant(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                self._admit(method, request, context)
                return inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self._admit(method, request, context)
                with self._stream_slot(context):
                    yield from inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)
        # Client-streaming calls (server reflection): the token is all there is to check.
        inner = handler.stream_stream or handler.stream_unary
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.stream_stream is not None
            else grpc.stream_unary_rpc_method_handler
        )

        def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            self._admit(method, None, context)
            return inner(requests, context)

        return make(streaming, handler.request_deserializer, serialize)

    def _admit(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        """Return if the call may go on; otherwise abort it (context.abort raises)."""
        authorization = _metadata_value(context, "authorization")
        verdict = self.auth.check(method, authorization)
        if verdict is not Verdict.ALLOWED:
            log.info("refused %s from %s: %s", method, context.peer(), verdict.value)
            self._reject(context, *_VERDICT_STATUS[verdict])
        if self.rate is not None and method.startswith(SERVICE_PREFIX):
            if not self.rate.allow(client_key(authorization, context.peer())):
                self._reject(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"rate limit of {self.rate.rate_per_s:g} calls/s exceeded; retry later",
                )
        if request is _MALFORMED:
            self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed request: the bytes are not a valid {method.rsplit('/', 1)[-1]} request",
            )

    def _stream_slot(self, context: grpc.ServicerContext) -> _Slot:
        if self.streams is not None and not self.streams.try_acquire():
            self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.streams.capacity} streams are running, the most this server takes;"
                " retry later",
            )
        return _Slot(self.streams)

    def _reject(self, context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        with self._lock:
            self.num_rejected += 1
        context.abort(code, details)


def gate_from_config(config: CoordinatorConfig) -> GateInterceptor:
    """The gate a coordinator's config asks for (a limit of 0 is no limit)."""
    rate = None
    if config.rate_limit_rps > 0:
        burst = config.rate_limit_burst or max(1, round(config.rate_limit_rps))
        rate = RateLimiter(config.rate_limit_rps, burst)
    streams = StreamSlots(config.max_concurrent_streams) if config.max_concurrent_streams else None
    return GateInterceptor(Authenticator(config.auth_tokens, config.admin_tokens), rate, streams)


class _Slot:
    """Releases a stream slot when the stream ends, however it ends (done, failed, cancelled)."""

    def __init__(self, slots: StreamSlots | None) -> None:
        self._slots = slots

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        if self._slots is not None:
            self._slots.release()


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that marks unparsable bytes instead of raising, so the call can be
    answered with INVALID_ARGUMENT (gRPC itself would answer INTERNAL)."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # DecodeError, bad UTF-8 in a string field, ...
            return _MALFORMED

    return parse


def _metadata_value(context: grpc.ServicerContext, key: str) -> str | None:
    for item in context.invocation_metadata() or ():
        if item.key == key:
            value = item.value
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None
