"""The gRPC server's gate: authentication, per-client rate, concurrent streams, malformed bytes.

A thin gRPC shell around the pure policies in `auth.py` and `limits.py` (the one other coordinator
module that imports grpc besides `service.py`: interceptors are a gRPC type). Every call of the
KVMesh service passes, in this order:

    authorization metadata  -> UNAUTHENTICATED / PERMISSION_DENIED     (auth.Authenticator)
    client's token bucket   -> RESOURCE_EXHAUSTED                      (limits.RateLimiter)
    request bytes           -> INVALID_ARGUMENT if they do not parse   (instead of gRPC's INTERNAL)
    field sizes             -> INVALID_ARGUMENT over a limit           (field_limits.FieldLimits)
    a free stream slot      -> RESOURCE_EXHAUSTED (streaming calls)    (limits.StreamSlots)

The bucket is the caller's identity: its token once authenticated, else its address, never a
header it made up (`auth.client_key`). While a stream runs, every response it hands to gRPC must
be sent within the send budget (`limits.SendWatch`); a stream whose client stopped reading is
cancelled by the gate's watchdog thread and its slot freed.

Health checks skip the gate. Nothing here logs metadata, so a token never reaches a log line.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.service.auth import OPEN_METHOD_PREFIXES, Authenticator, Verdict, client_key
from kvmesh.coordinator.service.field_limits import FieldLimits
from kvmesh.coordinator.service.limits import RateLimiter, SendWatch, StreamSlots

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
    """Counts refusals in `num_rejected` and streams cancelled for not reading in
    `num_slow_streams_cancelled` (both reported by `Stats`). `close()` stops the watchdog."""

    def __init__(
        self,
        auth: Authenticator,
        rate: RateLimiter | None = None,
        streams: StreamSlots | None = None,
        *,
        fields: FieldLimits | None = None,
        send_watch: SendWatch | None = None,
    ) -> None:
        self.auth = auth
        self.rate = rate
        self.streams = streams
        self.fields = fields
        self.send_watch = send_watch
        self.num_rejected = 0
        self.num_slow_streams_cancelled = 0
        self._lock = threading.Lock()
        self._running: dict[int, tuple[grpc.ServicerContext, _Slot]] = {}
        self._next_stream = itertools.count()
        self._closed = threading.Event()
        if send_watch is not None:
            interval = min(1.0, send_watch.budget_s / 4)
            threading.Thread(
                target=self._watch, args=(interval,), name="kvmesh-send-watch", daemon=True
            ).start()

    def close(self) -> None:
        self._closed.set()

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
                slot = self._stream_slot(context)
                stream = next(self._next_stream)
                with self._lock:
                    self._running[stream] = (context, slot)
                watch = self.send_watch
                try:
                    for response in inner_us(request, context):
                        if watch is not None:
                            watch.sending(stream)
                        yield response  # returns once gRPC has sent it and asks for the next
                        if watch is not None:
                            watch.sent(stream)
                finally:
                    if watch is not None:
                        watch.sent(stream)
                    with self._lock:
                        self._running.pop(stream, None)
                    slot.release()

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
            key = client_key(authorization, context.peer(), authenticated=self.auth.enabled)
            if not self.rate.allow(key):
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
        if self.fields is not None and isinstance(request, Message):
            problem = self.fields.problem(request)
            if problem is not None:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, problem)

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

    def _watch(self, interval_s: float) -> None:
        """Cancel the streams whose client stopped reading; their slots free at once (the
        stream's own cleanup runs when gRPC drops it, and releasing twice is harmless)."""
        assert self.send_watch is not None
        while not self._closed.wait(interval_s):
            for stream in self.send_watch.overdue():
                with self._lock:
                    running = self._running.pop(stream, None)
                if running is None:
                    continue
                context, slot = running
                log.info("cancelled a stream from %s: not read for %.1f s",
                         context.peer(), self.send_watch.budget_s)  # fmt: skip
                context.cancel()
                slot.release()
                self.send_watch.sent(stream)
                with self._lock:
                    self.num_slow_streams_cancelled += 1


def gate_from_config(
    config: CoordinatorConfig, fields: FieldLimits | None = None
) -> GateInterceptor:
    """The gate a coordinator's config asks for (a limit of 0 is no limit)."""
    rate = None
    if config.rate_limit_rps > 0:
        burst = config.rate_limit_burst or max(1, round(config.rate_limit_rps))
        rate = RateLimiter(config.rate_limit_rps, burst)
    streams = StreamSlots(config.max_concurrent_streams) if config.max_concurrent_streams else None
    timeout = config.stream_send_timeout_s
    return GateInterceptor(
        Authenticator(config.auth_tokens, config.admin_tokens),
        rate,
        streams,
        fields=fields or FieldLimits(max_prompt_tokens=config.max_prompt_tokens or 1 << 17),
        send_watch=SendWatch(timeout) if timeout > 0 else None,
    )


class _Slot:
    """A stream's slot, released exactly once however the stream ends (done, failed, cancelled
    by its client or by the send watchdog)."""

    def __init__(self, slots: StreamSlots | None) -> None:
        self._slots = slots
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()


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
