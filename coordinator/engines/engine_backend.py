"""Reaches external engines over their OpenAI-compatible HTTP API: the `WorkerBackend` for
engines, in front of the Ray shell for kvmesh's own workers.

The coordinator hands a `WorkerRequest` (token ids + sampling) to `generate`; for an engine it
becomes one streamed `POST /v1/completions` with the token ids as the prompt, and the engine's
SSE chunks come back as `RequestOutput`s, token by token. The engine's own cache facts arrive in
its usage chunk (`prompt_tokens_details.cached_tokens`, with vLLM's
`--enable-prompt-tokens-details`), so they ride on the final output. Closing the stream closes
the connection, which aborts the request on the engine.

    connection refused / reset before the first token  ->  the engine is down: `on_down`, then
                                                           WorkerDied (the coordinator migrates)
    HTTP 4xx                                            ->  RequestRejected (the client's fault)
    HTTP 5xx, a broken stream                           ->  WorkerFailed
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvmesh.coordinator.contract import WorkerDied
from kvmesh.workers.contract.replies import (
    PrefillFacts,
    RequestOutput,
    RequestRejected,
    WorkerFailed,
)
from kvmesh.workers.contract.requests import WorkerRequest

log = logging.getLogger(__name__)


class Backend(Protocol):
    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]: ...
    def send(
        self, worker_id: str, request: WorkerRequest
    ) -> Generator[RequestOutput, None, None]: ...


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    engine_id: str
    base_url: str
    """e.g. http://127.0.0.1:8001 (the `/v1/...` paths are appended)."""
    model_name: str = ""
    """The engine's served model name; empty: learned from `GET /v1/models`."""
    timeout_s: float = 600.0
    """Longest silence while streaming (a long prefill on a slow engine)."""


def completion_body(request: WorkerRequest, model_name: str) -> dict[str, Any]:
    """The `/v1/completions` body for a kvmesh request (vLLM's sampling extensions included)."""
    s = request.sampling
    body: dict[str, Any] = {
        "prompt": list(request.prompt_ids),
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": s.ignore_eos,
    }
    if model_name:
        body["model"] = model_name
    if s.top_k:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.temperature > 0:
        body["seed"] = s.seed
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


def outputs_from_sse(
    request_id: str, prompt_len: int, lines: Iterator[bytes]
) -> Iterator[RequestOutput]:
    """An engine's SSE lines -> outputs: one per chunk with tokens, then a final one carrying
    the finish reason and the cache facts of the usage chunk."""
    reason = ""
    cached: int | None = None
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise WorkerFailed(f"engine error: {chunk['error']}")
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            cached = details["cached_tokens"]
        for choice in chunk.get("choices") or []:
            token_ids = tuple(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                reason = str(choice["finish_reason"])
            if token_ids:
                yield RequestOutput(request_id, token_ids, False)
    local = min(cached or 0, max(prompt_len - 1, 0))
    facts = PrefillFacts(local, 0, 0, prompt_len - local)
    yield RequestOutput(request_id, (), True, reason or "stop", facts)


class EngineBackend:
    """Engines by id over HTTP; every other worker id goes to `fallback` (the Ray shell).
    `on_down(engine_id, why)` is told when an engine cannot be reached."""

    def __init__(
        self,
        engines: Mapping[str, EngineEndpoint],
        fallback: Backend | None,
        on_down: Callable[[str, str], None] = lambda _e, _why: None,
    ) -> None:
        self.engines = dict(engines)
        self.fallback = fallback
        self.on_down = on_down
        self._model_names: dict[str, str] = {}

    def is_engine(self, worker_id: str) -> bool:
        return worker_id in self.engines

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        engine = self.engines.get(worker_id)
        if engine is None:
            if self.fallback is None:
                raise WorkerDied(worker_id)
            return self.fallback.generate(worker_id, request)
        return self._proxy(engine, request)

    def send(self, worker_id: str, request: WorkerRequest) -> Generator[RequestOutput, None, None]:
        """An engine's request goes out on the first read (an HTTP stream has nothing to abort
        before it); other workers' at once, through `fallback`."""
        engine = self.engines.get(worker_id)
        if engine is None:
            if self.fallback is None:
                raise WorkerDied(worker_id)
            return self.fallback.send(worker_id, request)
        return self._proxy(engine, request)

    def _proxy(
        self, engine: EngineEndpoint, request: WorkerRequest
    ) -> Generator[RequestOutput, None, None]:
        url = urlsplit(engine.base_url)
        conn = _connection(engine, url.scheme, url.netloc)
        try:
            body = json.dumps(completion_body(request, self.model_name(engine))).encode()
            try:
                conn.request(
                    "POST",
                    url.path.rstrip("/") + "/v1/completions",
                    body,
                    {"Content-Type": "application/json", "Accept": "text/event-stream"},
                )
                response = conn.getresponse()
            except OSError as exc:
                self.on_down(engine.engine_id, f"cannot reach {engine.base_url}: {exc}")
                raise WorkerDied(engine.engine_id) from None
            if response.status >= 400:
                text = response.read(4096).decode("utf-8", "replace")
                if response.status < 500:
                    raise RequestRejected(f"engine {engine.engine_id}: {_message(text)}")
                raise WorkerFailed(f"engine {engine.engine_id} ({response.status}): {text}")
            try:
                yield from outputs_from_sse(
                    request.request_id, len(request.prompt_ids), iter(response.readline, b"")
                )
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise WorkerFailed(f"engine {engine.engine_id}: broken stream ({exc})") from None
        finally:
            conn.close()

    def model_name(self, engine: EngineEndpoint) -> str:
        """The engine's served model name (asked once); empty if it does not say."""
        if engine.model_name:
            return engine.model_name
        name = self._model_names.get(engine.engine_id)
        if name is None:
            name = fetch_model_name(engine)
            if name:
                self._model_names[engine.engine_id] = name
        return name


def fetch_model_name(engine: EngineEndpoint) -> str:
    url = urlsplit(engine.base_url)
    conn = _connection(engine, url.scheme, url.netloc, timeout_s=5.0)
    try:
        conn.request("GET", url.path.rstrip("/") + "/v1/models")
        response = conn.getresponse()
        if response.status != 200:
            return ""
        data = json.loads(response.read()).get("data") or []
        return str(data[0].get("id", "")) if data else ""
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    finally:
        conn.close()


def _connection(
    engine: EngineEndpoint, scheme: str, netloc: str, timeout_s: float | None = None
) -> http.client.HTTPConnection:
    timeout = timeout_s if timeout_s is not None else engine.timeout_s
    if scheme == "https":
        return http.client.HTTPSConnection(netloc, timeout=timeout)
    return http.client.HTTPConnection(netloc, timeout=timeout)


def _message(text: str) -> str:
    """The engine's error message, out of its JSON body when it has one."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    msg = err.get("message") if isinstance(err, dict) else None
    return str(msg or body.get("message") or text)[:500] if isinstance(body, dict) else text[:500]
