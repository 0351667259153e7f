"""The OpenAI wire format's response bodies: completions, chat completions, streamed chunks,
models, and the usage / kvmesh cache facts they carry. Pure: dicts ready for JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV was reused (from the worker's pool or pulled from a peer)."""

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class CacheFacts:
    """kvmesh's per-request facts, sent in the `kvmesh` extension field."""

    worker_id: str
    cached_tokens: int
    """Reused from the chosen worker's own pool."""
    pulled_tokens: int
    """Fetched from a peer worker before the prefill."""
    computed_tokens: int
    policy: str

    def body(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "cached_tokens": self.cached_tokens,
            "pulled_tokens": self.pulled_tokens,
            "computed_tokens": self.computed_tokens,
            "policy": self.policy,
        }


def completion_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage,
    facts: CacheFacts | None,
) -> dict[str, Any]:  # fmt: skip
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _with_facts(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage.body(),
        },
        facts,
    )


def chat_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage,
    facts: CacheFacts | None,
) -> dict[str, Any]:  # fmt: skip
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return _with_facts(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage.body(),
        },
        facts,
    )


def chunk_body(
    chat: bool, request_id: str, created: int, model: str, text: str | None,
    finish_reason: str | None, *, first: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk. `text` None with `finish_reason` None is the usage-only chunk's shape
    (no choices); the caller adds `usage` / `kvmesh` to it."""
    choices: list[dict[str, Any]] = []
    if text is not None or finish_reason is not None:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            elif first:
                delta["content"] = ""
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        choices.append(choice)
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def models_body(
    model: str, created: int, owner: str = "kvmesh", adapters: Sequence[str] = ()
) -> dict[str, Any]:
    entry = {"id": model, "object": "model", "created": created, "owned_by": owner}
    loras = [{**entry, "id": name, "parent": model} for name in adapters]
    return {"object": "list", "data": [entry, *loras]}


def _with_facts(body: dict[str, Any], facts: CacheFacts | None) -> dict[str, Any]:
    if facts is not None:
        body["kvmesh"] = facts.body()
    return body
