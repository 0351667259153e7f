"""The OpenAI wire format, without HTTP: request bodies -> typed requests, results -> JSON bodies.

Pure and strict: a request that this server would misread (n > 1, logprobs, penalties, a batch of
prompts, a field of the wrong type) is refused with `OpenAIError` (400) naming the field, never
silently served differently. Unknown fields are ignored, as vLLM and SGLang do, so clients that
send extra options still work. kvmesh's own options ride in the same body (the `openai` client's
`extra_body`): `session_id`, `cache_salt`, `top_k`, `stop_token_ids`, `ignore_eos`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.coordinator.service.chat_template import ChatMessage

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512

# HTTP status -> OpenAI error `type`.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Ways clients and routers spell "not asked for" (chat's logprobs is a bool, tools a list).
_ABSENT: tuple[Any, ...] = (False, [], {})
# Options the engine cannot honour: refused unless absent or at their no-op value.
_UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "response_format": None,
}


class OpenAIError(Exception):
    """A request that gets an error body of the OpenAI shape and an HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, *, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_tokens: int | None
    """Tokens to generate; None: up to the model's context (chat's default)."""
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    """None: a fresh seed per request (OpenAI's default is to sample anew)."""
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with `usage` and no choices."""
    session_id: str
    cache_salt: str


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    """Text, or token ids."""
    params: GenerationParams


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    params: GenerationParams


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or messages to template (routers ask it for token ids)."""

    model: str
    prompt: str | tuple[ChatMessage, ...]
    add_special_tokens: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    fields = _object(body)
    model = fields.get("model") or ""
    if not isinstance(model, str):
        raise OpenAIError(400, "model must be a string", param="model")
    add_special_tokens = fields.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise OpenAIError(400, "add_special_tokens must be true or false", "add_special_tokens")
    if "messages" in fields:
        return TokenizeRequest(model, parse_chat({**fields, "model": "-"}).messages, True)
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError(400, "give a prompt string or messages", param="prompt")
    return TokenizeRequest(model, prompt, add_special_tokens)


def parse_completion(body: Any) -> CompletionRequest:
    fields = _object(body)
    prompt = _prompt(fields.get("prompt"))
    params = _params(fields, default_max_tokens=16, max_tokens_keys=("max_tokens",))
    return CompletionRequest(_model(fields), prompt, params)


def parse_chat(body: Any) -> ChatRequest:
    fields = _object(body)
    raw = fields.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpenAIError(400, "messages must be a non-empty array", param="messages")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    params = _params(
        fields, default_max_tokens=None, max_tokens_keys=("max_completion_tokens", "max_tokens")
    )
    return ChatRequest(_model(fields), messages, params)


# ---- field readers -----------------------------------------------------------------------------


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in _ABSENT:
            raise OpenAIError(400, f"{name}={value!r} is not supported by this server", param=name)
    return body


def _model(fields: Mapping[str, Any]) -> str:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model must be a non-empty string", param="model")
    return model


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        if min(value) < 0:
            raise OpenAIError(400, "prompt token ids must be >= 0", param="prompt")
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise OpenAIError(400, "send one prompt per request (batches are not supported)", "prompt")
    raise OpenAIError(
        400, "prompt must be a non-empty string or a non-empty array of token ids", param="prompt"
    )


def _message(value: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{param} must be an object", param=param)
    role, content = value.get("role"), value.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise OpenAIError(400, f"{param}: only text content parts are supported", param)
            texts.append(_string(part.get("text"), f"{param}.content"))
        content = "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise OpenAIError(400, f"{param} needs a string role and string content", param=param)
    try:
        return ChatMessage(role, content)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=f"{param}.role") from None


def _params(
    fields: Mapping[str, Any], *, default_max_tokens: int | None, max_tokens_keys: tuple[str, ...]
) -> GenerationParams:
    max_tokens = default_max_tokens
    for key in max_tokens_keys:
        if fields.get(key) is not None:
            max_tokens = _int(fields, key, 1, None)
            break
    temperature = _number(fields, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(fields, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise OpenAIError(400, "top_p must be in (0, 1]", param="top_p")
    seed = None if fields.get("seed") is None else _int(fields, "seed", 0, (1 << 63) - 1)
    stream_options = fields.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise OpenAIError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool((stream_options or {}).get("include_usage", False))
    stop_token_ids = fields.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise OpenAIError(400, "stop_token_ids must be an array of integers", "stop_token_ids")
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if fields.get("top_k") in (None, -1) else _int(fields, "top_k", 0, None),
        seed=seed,
        stop=_stop(fields.get("stop")),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_bool(fields, "ignore_eos"),
        stream=_bool(fields, "stream"),
        include_usage=include_usage,
        session_id=_string(fields.get("session_id", ""), "session_id"),
        cache_salt=_string(fields.get("cache_salt", ""), "cache_salt"),
    )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(400, "stop must be a non-empty string or an array of them", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise OpenAIError(
            400,
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} chars",
            param="stop",
        )
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(fields: Mapping[str, Any], name: str, low: int, high: int | None) -> int:
    value: Any = fields.get(name)
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise OpenAIError(400, f"{name} must be an integer {bound}, got {value!r}", param=name)
    return int(value)


def _number(fields: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = fields.get(name)
    if value is None:
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise OpenAIError(
            400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name
        )
    return float(value)


def _bool(fields: Mapping[str, Any], name: str) -> bool:
    value = fields.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise OpenAIError(400, f"{name} must be a string, got {type(value).__name__}", param=name)
    return value
