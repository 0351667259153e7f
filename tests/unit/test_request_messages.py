"""A request message's prompt prepares to what the same ids as a list prepare to (the message's
ids are read as an array, in one copy), and refuses what the list would refuse."""

from __future__ import annotations

import random

import pytest

from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.contract import InvalidRequest
from kvmesh.coordinator.prompt_preparer import PromptPreparer
from kvmesh.coordinator.service.request_messages import prepared_prompt
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto.token_ids import TokenIds
from kvmesh.workers.model.model_config import preset


def preparer() -> PromptPreparer:
    return PromptPreparer(CoordinatorConfig(model="tiny-random"), preset("tiny-random"))


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 1000])
def test_a_message_prepares_as_its_ids_as_a_list(num_tokens: int) -> None:
    rng = random.Random(num_tokens)
    ids = [rng.randrange(preset("tiny-random").vocab_size) for _ in range(num_tokens)]
    prompts = preparer()
    got = prepared_prompt(prompts, 0, pb.GenerateRequest(token_ids=ids, cache_salt="t"))
    want = prompts.prepare(ids, "", "t")
    assert got == want
    assert all(type(t) is int for t in got.token_ids)
    assert isinstance(got.token_ids, TokenIds)  # one buffer from here to the worker
    assert got.block_hash_array is not None and want.block_hash_array is not None
    assert got.block_hash_array.tolist() == want.block_hash_array.tolist()


@pytest.mark.parametrize(
    ("ids", "message"),
    [([], "empty"), ([3, preset("tiny-random").vocab_size], "outside the vocabulary")],
)
def test_a_message_is_refused_as_the_list_is(ids: list[int], message: str) -> None:
    prompts = preparer()
    with pytest.raises(InvalidRequest, match=message):
        prepared_prompt(prompts, 0, pb.GenerateRequest(token_ids=ids))
    with pytest.raises(InvalidRequest, match=message):
        prompts.prepare(ids, "", "")


@pytest.mark.parametrize("ids", [[4, -3, 5], [4, 2**32], [4, 2.0]])
def test_an_id_that_is_no_uint32_is_refused_by_name(ids: list[object]) -> None:
    with pytest.raises(InvalidRequest, match=f"token id {ids[1]!r} is outside the vocabulary"):
        preparer().prepare(ids, "", "")  # type: ignore[arg-type]


def test_ids_and_text_together_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="either token_ids or prompt"):
        prepared_prompt(preparer(), 0, pb.GenerateRequest(token_ids=[1, 2], prompt="hi"))
