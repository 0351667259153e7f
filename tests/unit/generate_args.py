"""`wire.build_generate_request`'s keyword arguments as `Client.generate` defaults them, for the
tests that build a request with one or two of them changed."""

from __future__ import annotations

from typing import Any


def generate_args(**changes: Any) -> dict[str, Any]:
    """Every argument but the token ids, with `changes` over the defaults."""
    return {
        "prompt": None,
        "max_tokens": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": 0,
        "stop_token_ids": (),
        "ignore_eos": False,
        "session_id": "",
        "cache_salt": "",
        "worker_id": "",
        "request_id": "",
    } | changes
