"""Generate / Route / Lookup request messages as the coordinator's inputs: the prompt (within
`max_prompt_tokens`), sampling, turn mode, adapter and media items. Bad input raises
`InvalidRequest` or `ValueError` (the servicer answers INVALID_ARGUMENT)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmesh.coordinator.contract import InvalidRequest
from kvmesh.coordinator.prompt_preparer import PreparedPrompt, PromptPreparer
from kvmesh.coordinator.session_turns import TurnMode
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto.block_hash import MediaItem
from kvmesh.workers.contract.requests import SamplingConfig

_TURN_MODES = {
    pb.TURN_MODE_CONCURRENT: TurnMode.CONCURRENT,
    pb.TURN_MODE_REFUSE: TurnMode.REFUSE,
    pb.TURN_MODE_QUEUE: TurnMode.QUEUE,
}


def prepared_prompt(
    prompts: PromptPreparer, max_prompt_tokens: int, request: Any
) -> PreparedPrompt:
    """`PromptPreparer.prepare` within `max_prompt_tokens` (0: no limit; checked before hashing,
    and again after tokenizing a text prompt), with the request's adapter, media items and
    `bypass_cache` (Generate and Route have one)."""
    token_ids = request.token_ids
    limit = max_prompt_tokens
    prepared = None
    if not limit or len(token_ids) <= limit:
        adapter, media = adapter_and_media(request)
        prepared = prompts.prepare(
            np.array(token_ids, dtype=np.uint32),  # one copy out of the message, in C
            request.prompt,
            request.cache_salt,
            adapter=adapter,
            media=media,
            bypass_cache=bool(getattr(request, "bypass_cache", False)),
        )
        if not limit or len(prepared.token_ids) <= limit:
            return prepared
    n = len(token_ids) if prepared is None else len(prepared.token_ids)
    raise InvalidRequest(f"prompt of {n} tokens is over this server's max_prompt_tokens {limit}")


def sampling_of(request: pb.GenerateRequest) -> SamplingConfig:
    """The request's sampling; raises ValueError outside the safe ranges."""
    s = request.sampling
    if not request.HasField("sampling") or s.max_tokens == 0:
        raise InvalidRequest("sampling.max_tokens must be >= 1")
    return SamplingConfig(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=1.0 if s.top_p == 0 else s.top_p,  # proto3's default 0 means "not set"
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_p=s.min_p,
    )


def turn_mode_of(request: pb.GenerateRequest) -> TurnMode:
    mode = _TURN_MODES.get(request.turn_mode)
    if mode is None:
        raise InvalidRequest(f"unknown turn_mode {request.turn_mode}")
    return mode


def adapter_and_media(request: Any) -> tuple[str, tuple[MediaItem, ...]]:
    """The adapter name and media items of a Generate / Route / Lookup request (none: base)."""
    if request is None:
        return "", ()
    media = tuple(MediaItem(m.hash, m.offset, m.length) for m in request.media)
    return request.adapter, media
