"""Generate / Route / Lookup messages become the coordinator's inputs, and bad ones raise
before anything is routed (`coordinator/service/request_messages.py`)."""

from __future__ import annotations

import pytest

from kvmesh.coordinator.contract import InvalidRequest
from kvmesh.coordinator.service.request_messages import (
    adapter_and_media,
    prepared_prompt,
    sampling_of,
    turn_mode_of,
)
from kvmesh.coordinator.session_turns import TurnMode
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto.block_hash import MediaItem
from tests.unit.test_coordinator import make


def test_a_prompt_over_max_prompt_tokens_is_refused_with_its_length() -> None:
    c, _, _, _ = make()
    request = pb.GenerateRequest(token_ids=list(range(1, 41)))
    assert len(prepared_prompt(c.prompts, 40, request).token_ids) == 40
    assert len(prepared_prompt(c.prompts, 0, request).token_ids) == 40  # 0: no limit
    with pytest.raises(InvalidRequest, match="prompt of 40 tokens is over .* 39"):
        prepared_prompt(c.prompts, 39, request)


def test_sampling_needs_max_tokens_and_reads_top_p_zero_as_unset() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens must be >= 1"):
        sampling_of(pb.GenerateRequest(token_ids=[1]))
    sampling = sampling_of(
        pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=3, stop_token_ids=[7]))
    )
    assert (sampling.max_tokens, sampling.top_p, sampling.stop_token_ids) == (3, 1.0, (7,))
    with pytest.raises(ValueError):
        sampling_of(pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1, top_p=2.0)))


def test_turn_modes_map_one_to_one_and_an_unknown_one_is_refused() -> None:
    assert turn_mode_of(pb.GenerateRequest()) is TurnMode.CONCURRENT
    assert turn_mode_of(pb.GenerateRequest(turn_mode=pb.TURN_MODE_QUEUE)) is TurnMode.QUEUE
    with pytest.raises(InvalidRequest, match="unknown turn_mode 99"):
        turn_mode_of(pb.GenerateRequest(turn_mode=99))


def test_media_items_keep_their_hash_and_token_span() -> None:
    request = pb.RouteRequest(adapter="a1", media=[pb.MediaItem(hash=5, offset=2, length=3)])
    assert adapter_and_media(request) == ("a1", (MediaItem(5, 2, 3),))
    assert adapter_and_media(None) == ("", ())
