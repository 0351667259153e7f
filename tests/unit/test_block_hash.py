from __future__ import annotations

import numpy as np
import pytest

from kvmesh.proto.block_hash import (
    BlockHash,
    block_hash_array,
    block_hashes,
    namespace_hash,
)
from kvmesh.proto.token_ids import TokenIds

ROOT = namespace_hash("tiny-random-abc")


def test_hashes_match_pinned_vectors() -> None:
    # Pinned: the same bytes must hash the same in every process, machine and release.
    assert ROOT == 0xDAA2071FC7256916
    assert block_hashes(list(range(40)), 16, ROOT) == [0x15F0AAC05320567B, 0x19400C54A31A1B7A]
    assert namespace_hash("m", "", "tenant-a") == 0xB07C8912F0BCBA58


def test_extra_keys_break_the_chain_at_their_block() -> None:
    plain = block_hashes(list(range(32)), 16, ROOT)
    with_image = block_hashes(list(range(32)), 16, ROOT, {1: [0xDEADBEEF]})
    assert with_image == [0x15F0AAC05320567B, 0xA5AF4C2C97AB8E02]
    assert with_image[0] == plain[0] and with_image[1] != plain[1]


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(47)), 16, ROOT)) == 2
    assert block_hashes([], 16, ROOT) == []


def test_chain_depends_on_every_earlier_block() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16, ROOT)
    b = block_hashes([3] * 16 + [2] * 16, 16, ROOT)
    assert a[1] != b[1]


def test_namespaces_never_share_hashes() -> None:
    tokens = list(range(64))
    assert set(block_hashes(tokens, 16, namespace_hash("m", "", "a"))).isdisjoint(
        block_hashes(tokens, 16, namespace_hash("m", "", "b"))
    )
    assert namespace_hash("model-a") != namespace_hash("model-b")


def test_numpy_and_list_inputs_agree() -> None:
    tokens = np.arange(100, 164, dtype=np.int64)
    assert block_hashes(tokens, 16, ROOT) == block_hashes(tokens.tolist(), 16, ROOT)


def test_the_ids_as_a_uint32_array_hash_as_the_list_or_are_refused_if_they_do_not_fit() -> None:
    ids = [0, 7, 2**32 - 1] + list(range(45))
    array = TokenIds(ids).array
    assert array is not None and array.dtype == np.uint32 and array.tolist() == ids
    assert block_hashes(array[16:48], 16, ROOT) == block_hashes(ids[16:48], 16, ROOT)
    for bad in ([1, -1], [2**32], [1, 2.0], ["3"]):
        with pytest.raises(ValueError):
            TokenIds(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            block_hashes(bad * 16, 16, ROOT)  # type: ignore[arg-type]


def test_the_chain_as_an_array_holds_the_same_hashes() -> None:
    hashes = block_hashes(list(range(16 * 50)), 16, ROOT)
    array = block_hash_array(hashes)
    assert array.dtype == np.uint64 and array.tolist() == hashes
    assert block_hash_array([]).tolist() == []


def test_bad_input_raises_with_numbers() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0, ROOT)
    with pytest.raises(ValueError, match="uint32"):
        block_hashes([-1] * 16, 16, BlockHash(0))


def test_the_block_of_the_last_prompt_token_is_never_reused() -> None:
    from kvmesh.proto.block_hash import num_reusable_blocks, num_reusable_tokens

    assert num_reusable_blocks(33, 16) == 2  # | 16 | 16 | 1 |: both full blocks
    assert num_reusable_blocks(32, 16) == 1  # | 16 | 16 |: the second holds the last token
    assert num_reusable_blocks(1, 16) == 0
    assert num_reusable_tokens(32, 5, 16) == 16 and num_reusable_tokens(100, 1, 16) == 16
    with pytest.raises(ValueError):
        num_reusable_blocks(0, 16)


def test_cache_root_is_pinned_and_moves_with_epoch_and_kv_dtype() -> None:
    from kvmesh.proto.block_hash import cache_root

    ns = namespace_hash("m", "", "tenant-a")
    assert cache_root(ns, "float32", 0) == 0x94814D3470090E6A
    assert cache_root(ns, "bfloat16", 3) == 0x1328D4D61E61248E
    roots = {cache_root(ns, d, e) for d in ("float32", "bfloat16") for e in (0, 1, 2)}
    assert len(roots) == 6 and ns not in roots
    with pytest.raises(ValueError):
        cache_root(ns, "float32", -1)
