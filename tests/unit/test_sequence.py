"""A sequence's token views and hash chain: the same whichever copy of its prompt it reads."""

from __future__ import annotations

import pytest

from kvmesh.proto.block_hash import BlockHash, block_hashes, token_id_array
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.engine.sequence import Sequence

BS = 4
ROOT = BlockHash(12345)


def seq(prompt: list[int], *, with_array: bool) -> Sequence:
    return Sequence(
        "r",
        list(prompt),
        SamplingConfig(max_tokens=32),
        ROOT,
        0.0,
        prompt_array=token_id_array(prompt) if with_array else None,
    )


@pytest.mark.parametrize("num_prompt", [1, 7, 8, 9])
def test_the_chain_is_the_same_from_the_prompt_array_as_from_the_list_as_tokens_arrive(
    num_prompt: int,
) -> None:
    prompt = [(i * 37) % 101 for i in range(num_prompt)]
    a, b = seq(prompt, with_array=True), seq(prompt, with_array=False)
    for token in range(13):  # the chain grows across the end of the prompt, block by block
        assert a.full_block_hashes(BS) == b.full_block_hashes(BS)
        assert a.full_block_hashes(BS) == block_hashes(a.all_ids, BS, ROOT)
        assert a.reusable_block_hashes(BS) == a.full_block_hashes(BS)[: (a.num_tokens - 1) // BS]
        a.output_ids.append(token)
        b.output_ids.append(token)


def test_ids_from_is_all_ids_from_there() -> None:
    s = seq(list(range(10, 19)), with_array=True)
    s.output_ids.extend([1, 2, 3])
    for start in range(s.num_tokens + 2):
        assert s.ids_from(start) == s.all_ids[start:]
