"""The OpenAI-compatible HTTP face of the coordinator: the only module that imports the HTTP stack
(Starlette on uvicorn). Translation lives in `openai_frontend.py` / `openai_schema.py`; this
shell reads bodies, applies the gate and writes JSON or server-sent events.

    GET  /health                    open (no token): 200 while a worker can serve, else 503
    GET  /v1/models                 the served model
    POST /v1/completions            text or token-id prompt; stream=true answers with SSE
    POST /v1/chat/completions       messages through the chat template; SSE as above
    POST /tokenize                  vLLM's: prompt or messages -> the token ids the engine sees
    /workers/{id}/...               the same routes pinned to one worker (for third-party
                                    routers), plus /health_generate and /[get_]server_info,
                                    /[get_]model_info, which SGLang's router probes

The gate is gRPC's, shared: the same bearer tokens (`auth.Authenticator`), and the same
`RateLimiter` / `StreamSlots` objects, so a client's budget covers both protocols.

    no or unknown bearer token -> 401      over the rate or the stream cap -> 429
    bad JSON or field          -> 400      unknown path, model or worker   -> 404
    no live worker             -> 503      body over max_body_bytes        -> 413
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmesh.coordinator.config import HttpConfig
from kvmesh.coordinator.service.auth import Authenticator, Verdict, client_key
from kvmesh.coordinator.service.limits import RateLimiter, StreamSlots
from kvmesh.coordinator.service.openai_frontend import OpenAIFrontend
from kvmesh.coordinator.service.openai_schema import OpenAIError

log = logging.getLogger(__name__)

_DONE = object()


class HttpGate:
    """Auth, per-client rate and concurrent streams for HTTP calls; counts refusals."""

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

    def admit(self, request: Request) -> None:
        """Return if the call may go on; raise OpenAIError (401 / 429) if not."""
        authorization = request.headers.get("authorization")
        if self.auth.check("/http" + request.url.path, authorization) is not Verdict.ALLOWED:
            raise self._reject(
                401, "missing or unknown bearer token (send `Authorization: Bearer <token>`)",
                "invalid_api_key",
            )  # fmt: skip
        key = client_key(authorization, _peer(request), authenticated=self.auth.enabled)
        if self.rate is not None and not self.rate.allow(key):
            raise self._reject(
                429, f"rate limit of {self.rate.rate_per_s:g} calls/s exceeded; retry later",
                "rate_limit_exceeded",
            )  # fmt: skip

    def acquire_stream(self) -> None:
        if self.streams is not None and not self.streams.try_acquire():
            raise self._reject(
                429, f"{self.streams.capacity} streams are running, the most this server takes;"
                " retry later", "too_many_streams",
            )  # fmt: skip

    def release_stream(self) -> None:
        if self.streams is not None:
            self.streams.release()

    def _reject(self, status: int, message: str, code: str) -> OpenAIError:
        with self._lock:
            self.num_rejected += 1
        return OpenAIError(status, message, code=code)


def _peer(request: Request) -> str:
    """The client's address as gRPC spells it ("ipv4:10.0.0.7:53211"), so a client without a
    token has one rate bucket across both protocols."""
    if request.client is None:
        return ""
    host, port = request.client.host, request.client.port
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def build_app(
    frontend: OpenAIFrontend, gate: HttpGate, max_body_bytes: int, max_threads: int = 256
) -> Starlette:
    """`max_threads`: requests whose blocking work runs at once (a stream holds a thread while
    it waits for its next token); more wait for a thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = max_threads
        yield

    def error_response(err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def guarded(
        request: Request, call: Callable[[], Any], *, open_: bool = False
    ) -> Response:
        try:
            if not open_:  # health checks need no token, as gRPC's do not
                gate.admit(request)
            return await anyio.to_thread.run_sync(call)  # type: ignore[no-any-return]
        except OpenAIError as err:
            return error_response(err)

    async def health(request: Request) -> Response:
        worker_id = request.path_params.get("worker_id", "")

        def call() -> Response:
            status, body = frontend.health(worker_id)
            return JSONResponse(body, status_code=status)

        return await guarded(request, call, open_=True)

    async def models(request: Request) -> Response:
        worker_id = request.path_params.get("worker_id", "")

        def call() -> Response:
            if worker_id:
                frontend.check_worker(worker_id)
            return JSONResponse(frontend.models())

        return await guarded(request, call)

    async def server_info(request: Request) -> Response:
        worker_id = request.path_params.get("worker_id", "")

        def call() -> Response:
            frontend.check_worker(worker_id)
            return JSONResponse(frontend.server_info(worker_id))

        return await guarded(request, call)

    def generation(chat: bool) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                gate.admit(request)
                body = await _json_body(request, max_body_bytes)
            except OpenAIError as err:
                return error_response(err)
            worker_id = request.path_params.get("worker_id", "")
            run = frontend.chat if chat else frontend.completion
            return await _generate(gate, frontend, lambda: run(body, worker_id))

        return endpoint

    async def tokenize(request: Request) -> Response:
        try:
            gate.admit(request)
            body = await _json_body(request, max_body_bytes)
        except OpenAIError as err:
            return error_response(err)
        worker_id = request.path_params.get("worker_id", "")

        def call() -> Response:
            if worker_id:
                frontend.check_worker(worker_id)
            return JSONResponse(frontend.tokenize(body))

        return await guarded(request, call, open_=True)  # admitted above

    async def health_generate(request: Request) -> Response:
        return await health(request)

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return error_response(OpenAIError(405, f"{request.method} is not allowed here"))
        return error_response(OpenAIError(404, f"no route {request.url.path}", code="not_found"))

    routes = []
    for prefix in ("", "/workers/{worker_id}"):
        routes += [
            Route(prefix + "/health", health, methods=["GET"]),
            Route(prefix + "/v1/models", models, methods=["GET"]),
            Route(prefix + "/v1/completions", generation(False), methods=["POST"]),
            Route(prefix + "/v1/chat/completions", generation(True), methods=["POST"]),
            Route(prefix + "/tokenize", tokenize, methods=["POST"]),
        ]
    routes += [
        Route("/workers/{worker_id}/health_generate", health_generate, methods=["GET"]),
    ]
    for name in ("get_model_info", "get_server_info", "model_info", "server_info"):
        routes.append(Route("/workers/{worker_id}/" + name, server_info, methods=["GET"]))
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
    )


async def _json_body(request: Request, max_body_bytes: int) -> Any:
    """The parsed JSON body; 413 past `max_body_bytes` (checked on the declared length, then
    while reading, so a body is never held whole beyond the limit)."""
    too_large = OpenAIError(413, f"request body over this server's limit of {max_body_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_body_bytes:
            raise too_large
        parts.append(part)
    raw = b"".join(parts)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None


async def _generate(gate: HttpGate, frontend: OpenAIFrontend, start: Callable[[], Any]) -> Response:
    """Run the blocking request path in a worker thread; stream chunks as server-sent events."""
    try:
        gate.acquire_stream()
    except OpenAIError as err:
        return JSONResponse(err.body(), status_code=err.status)
    try:
        result = await anyio.to_thread.run_sync(start)
    except BaseException as exc:
        gate.release_stream()
        if not isinstance(exc, Exception):
            raise
        failure = frontend.error_for(exc)
        if failure.status >= 500:
            log.error("request failed: %s", exc, exc_info=failure.status == 500)
        return JSONResponse(failure.body(), status_code=failure.status)
    if isinstance(result, dict):
        gate.release_stream()
        return JSONResponse(result)
    return StreamingResponse(
        _sse(gate, result),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(gate: HttpGate, chunks: Iterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """`data: {json}` events, then `data: [DONE]`. Ends (and stops the worker's stream) when the
    client goes away."""
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(next, chunks, _DONE)
            if chunk is _DONE:
                break
            yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            close = getattr(chunks, "close", None)
            if close is not None:
                await anyio.to_thread.run_sync(close)
        gate.release_stream()


class HttpServer:
    """uvicorn serving the app from a background thread, on a socket bound before start()
    returns (so port 0 gives a known free port)."""

    def __init__(
        self,
        app: Starlette,
        config: HttpConfig,
        *,
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_client_ca_file: str = "",
    ) -> None:
        """With a TLS certificate the port speaks HTTPS only, and with a client CA it requires
        client certificates, as the gRPC port does."""
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._socket = socket.create_server((config.host, config.port), family=family)
        self.host = config.host
        self.port = int(self._socket.getsockname()[1])
        self.scheme = "https" if tls_cert_file else "http"
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=2,
                ssl_certfile=tls_cert_file or None,
                ssl_keyfile=tls_key_file or None,
                ssl_ca_certs=tls_client_ca_file or None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca_file else ssl.CERT_NONE,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="kvmesh-http",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.02)):
            if self._server.started or not self._thread.is_alive():
                break
            deadline.wait(0.02)
        if not self._server.started:
            raise OSError(f"the HTTP server did not start on {self.url}")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._socket.close()
