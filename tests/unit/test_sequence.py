"""A sequence's token views, hash chain and prefix match: the chain of its prompt buffer and its
answer as one list, and the same whether or not it remembered the last answer."""

from __future__ import annotations

import pytest

from kvmesh.proto.block_hash import BlockHash, block_hashes
from kvmesh.proto.token_ids import TokenIds
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.engine.sequence import Sequence
from kvmesh.workers.kv.block_pool import BlockId, BlockPool

BS = 4
ROOT = BlockHash(12345)


def seq(prompt: list[int]) -> Sequence:
    return Sequence("r", TokenIds(prompt), SamplingConfig(max_tokens=32), ROOT, 0.0)


@pytest.mark.parametrize("num_prompt", [1, 7, 8, 9])
def test_the_chain_is_the_chain_of_all_its_ids_as_tokens_arrive(num_prompt: int) -> None:
    prompt = [(i * 37) % 101 for i in range(num_prompt)]
    a = seq(prompt)
    for token in range(13):  # the chain grows across the end of the prompt, block by block
        assert a.all_ids == prompt + a.output_ids
        assert a.full_block_hashes(BS) == block_hashes(a.all_ids, BS, ROOT)
        assert a.reusable_block_hashes(BS) == a.full_block_hashes(BS)[: (a.num_tokens - 1) // BS]
        a.output_ids.append(token)


def test_ids_from_is_all_ids_from_there() -> None:
    s = seq(list(range(10, 19)))
    s.output_ids.extend([1, 2, 3])
    for start in range(s.num_tokens + 2):
        assert s.ids_from(start) == s.all_ids[start:]


def test_the_remembered_prefix_match_follows_the_pools_hashes_the_tokens_and_the_root() -> None:
    pool = BlockPool(8)
    s = seq(list(range(13)))  # 3 full blocks, all 3 reusable

    def registered(num_blocks: int, root: BlockHash) -> list[BlockId]:
        chain = block_hashes(s.all_ids, BS, root)
        blocks = pool.allocate(num_blocks)
        assert blocks is not None
        for i, b in enumerate(blocks):
            pool.register(b, chain[i], chain[i - 1] if i else root, depth=i + 1)
        return blocks

    def check() -> list[BlockId]:
        got = s.reusable_prefix_in(pool, BS)
        assert got == pool.match_prefix(s.reusable_block_hashes(BS))
        assert s.reusable_prefix_in(pool, BS) == got  # remembered: the same answer
        return got

    assert check() == []
    held = registered(2, ROOT)
    assert check() == held  # registered since: matched again
    s.output_ids.extend([1, 2, 3])  # 16 tokens: still 3 reusable blocks
    assert check() == held
    s.root_hash, s.block_hashes = BlockHash(999), []  # re-rooted as a cache reset does it
    assert check() == []  # nothing registered or evicted since, yet the old answer is gone
    pool.free(held)
    held = registered(3, BlockHash(999))
    assert check() == held
    pool.free(held)
    pool.evict_all_free()
    assert check() == []  # evicted since
