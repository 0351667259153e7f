"""Adapters in h_0 and media items in the blocks' extra keys (proto/block_hash.py)."""

from __future__ import annotations

import pytest

from kvmesh.proto.block_hash import (
    MediaItem,
    adapter_root,
    block_hashes,
    media_extra_keys,
    namespace_hash,
)

ROOT = namespace_hash("tiny-random-abc")
TOKENS = list(range(64))


def test_adapter_roots_are_pinned_and_the_base_model_keeps_its_root() -> None:
    assert adapter_root(ROOT, "") == ROOT
    assert adapter_root(ROOT, "sql") == 0x179EE1440DB6D86E
    assert adapter_root(ROOT, "sql") != adapter_root(ROOT, "chat")


def test_adapters_never_share_a_block_with_the_base_model_or_each_other() -> None:
    chains = [block_hashes(TOKENS, 16, adapter_root(ROOT, a)) for a in ("", "sql", "chat")]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(chains) for b in chains[i + 1 :])


def test_a_changed_image_breaks_the_chain_exactly_at_its_first_block() -> None:
    def chain(image_hash: int) -> list[int]:
        items = [MediaItem(image_hash, offset=20, length=24)]  # blocks 1 and 2 of 16
        return block_hashes(TOKENS, 16, ROOT, media_extra_keys(items, len(TOKENS), 16))

    plain = block_hashes(TOKENS, 16, ROOT)
    a, b = chain(0xA), chain(0xB)
    assert a[0] == b[0] == plain[0]
    assert a[1] != b[1] and a[1] != plain[1]
    assert a[2] != b[2] and a[3] != b[3]  # everything after it follows


def test_extra_keys_name_every_overlapping_item_in_offset_order() -> None:
    items = [MediaItem(7, 30, 4), MediaItem(5, 10, 8)]
    assert media_extra_keys(items, 40, 16) == {0: [5, 10], 1: [5, 10, 7, 30], 2: [7, 30]}
    swapped = [MediaItem(5, 30, 4), MediaItem(7, 10, 8)]
    assert media_extra_keys(swapped, 40, 16) != media_extra_keys(items, 40, 16)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (MediaItem(1, 60, 8), "offset 60 of length 8 does not lie within the prompt of 64"),
        (MediaItem(1, 3, 0), "offset 3 of length 0"),
        (MediaItem(1 << 64, 3, 1), "does not fit in 64 bits"),
    ],
)
def test_media_items_outside_the_prompt_are_refused_with_numbers(
    item: MediaItem, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        media_extra_keys([item], 64, 16)
