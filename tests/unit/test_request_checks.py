"""What a worker refuses: token ids outside the vocabulary, named as the largest id."""

from __future__ import annotations

import pytest

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.request_checks import check_request
from kvmesh.workers.model.model_config import preset

MODEL = preset("tiny-random")


def request(prompt: list[int]) -> WorkerRequest:
    return WorkerRequest("r", tuple(prompt), SamplingConfig(max_tokens=4))


@pytest.mark.parametrize(
    "prompt",
    [[1, MODEL.vocab_size], [-1, 5], [5, -(2**40)], [3, 2**32], [2**70, 1]],
)
def test_an_id_outside_the_vocabulary_is_refused_naming_the_largest_id(prompt: list[int]) -> None:
    message = f"token id {max(prompt)} is outside the vocabulary [0, {MODEL.vocab_size})"
    with pytest.raises(ValueError) as refused:
        check_request(request(prompt), MODEL, ())
    assert str(refused.value) == message


def test_a_prompt_it_takes_comes_back_as_its_uint32_ids() -> None:
    prompt = [0, 5, MODEL.vocab_size - 1]
    ids = check_request(request(prompt), MODEL, ())
    assert ids is not None and ids.tolist() == prompt
