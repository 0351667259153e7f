"""Engine hashes -> kvmesh's chained hashes: the same prefix on two engines (each with its own
opaque hashes) lands on the same kvmesh blocks, which are the coordinator's own prompt hashes."""

from __future__ import annotations

from kvmesh.coordinator.engines.chain_translator import ChainTranslator
from kvmesh.coordinator.engines.engine_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineHash,
)
from kvmesh.proto.block_hash import BlockHash, adapter_root, block_hashes, namespace_hash
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockRemoved, BlockStored

BS = 4


def _root(lora: str, salt: str = "") -> BlockHash:
    return adapter_root(namespace_hash("model-fp", "", salt), lora)


def _stored(
    hashes: list[object], parent: object, tokens: list[int], **kw: object
) -> EngineBlockStored:
    return EngineBlockStored(
        tuple(EngineHash(h) for h in hashes),
        None if parent is None else EngineHash(parent),
        tuple(tokens),
        BS,
        **kw,  # type: ignore[arg-type]
    )


def test_two_engines_with_different_hashes_map_to_the_coordinators_chain() -> None:
    tokens = list(range(12))
    expected = block_hashes(tokens, BS, _root(""))
    a, b = ChainTranslator(BS, _root), ChainTranslator(BS, _root)
    # engine a announces all three blocks at once, engine b in two events chained by parent
    out_a = a.translate(_stored([1, 2, 3], None, tokens))
    out_b1 = b.translate(_stored([b"x", b"y"], None, tokens[:8]))
    out_b2 = b.translate(_stored([b"z"], b"y", tokens[8:]))
    assert isinstance(out_a, BlockStored) and list(out_a.hashes) == expected
    assert isinstance(out_b1, BlockStored) and isinstance(out_b2, BlockStored)
    assert list(out_b1.hashes + out_b2.hashes) == expected
    assert out_b2.parent_hash == expected[1]
    for t in (a, b):
        t.check_invariants()


def test_removal_finds_the_kvmesh_hash_and_unknown_removals_are_counted() -> None:
    t = ChainTranslator(BS, _root)
    stored = t.translate(_stored([1, 2], None, list(range(8))))
    assert isinstance(stored, BlockStored)
    removed = t.translate(EngineBlockRemoved((EngineHash(2), EngineHash(99))))
    assert removed == BlockRemoved((stored.hashes[1],), 0)
    assert t.counters.num_unknown_removals == 1 and t.num_blocks == 1
    t.check_invariants()


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    t = ChainTranslator(BS, _root)
    assert t.translate(_stored([5], 4, [1, 2, 3, 4])) is None
    assert t.counters.num_orphan_blocks == 1 and t.num_blocks == 0


def test_wrong_block_size_and_other_groups_are_not_indexed() -> None:
    t = ChainTranslator(BS, _root)
    wrong = EngineBlockStored((EngineHash(1),), None, tuple(range(8)), 8)
    assert t.translate(wrong) is None and t.counters.num_wrong_block_size == 1
    assert t.translate(_stored([1], None, [1, 2, 3, 4], group_idx=1)) is None
    assert t.counters.num_other_groups == 1 and t.num_blocks == 0


def test_lora_name_and_extra_keys_change_the_chain() -> None:
    t = ChainTranslator(BS, _root)
    tokens = [1, 2, 3, 4]
    plain = t.translate(_stored([1], None, tokens))
    lora = t.translate(_stored([2], None, tokens, lora_name="adapter"))
    image = t.translate(_stored([3], None, tokens, extra_keys=(("img", 0),)))
    hashes = {e.hashes for e in (plain, lora, image) if isinstance(e, BlockStored)}
    assert len(hashes) == 3


def test_a_block_kept_by_two_engine_hashes_leaves_with_the_last() -> None:
    t = ChainTranslator(BS, _root)
    t.translate(_stored([1], None, [1, 2, 3, 4]))
    t.translate(_stored([2], None, [1, 2, 3, 4]))  # same content, another engine hash
    assert t.num_blocks == 1
    assert t.translate(EngineBlockRemoved((EngineHash(1),))) is None
    assert isinstance(t.translate(EngineBlockRemoved((EngineHash(2),))), BlockRemoved)
    t.check_invariants()


def test_cpu_medium_is_the_host_tier_and_clear_forgets_everything() -> None:
    t = ChainTranslator(BS, _root)
    host = t.translate(_stored([1], None, [1, 2, 3, 4], medium="CPU"))
    assert isinstance(host, BlockStored) and host.tier == TIER_HOST
    assert [e.tier for e in t.held()] == [TIER_HOST]
    assert t.translate(EngineAllCleared()) == AllCleared()
    assert t.num_blocks == 0 and t.held() == []


def test_vllms_lora_and_salt_extra_keys_move_into_the_root_as_the_coordinator_hashes_them() -> None:
    t = ChainTranslator(BS, _root)
    tokens = list(range(8))
    # vLLM repeats the LoRA name in every block's extra keys and the salt in the first block's
    extra = (("adapter", "tenant-1"), ("adapter",))
    out = t.translate(_stored([1, 2], None, tokens, lora_name="adapter", extra_keys=extra))
    assert isinstance(out, BlockStored)
    assert list(out.hashes) == block_hashes(tokens, BS, _root("adapter", "tenant-1"))
    # a multimodal (id, offset) pair stays in its block
    image = t.translate(_stored([3], None, tokens[:4], extra_keys=((("img", 0),),)))
    assert isinstance(image, BlockStored)
    assert list(image.hashes) != block_hashes(tokens[:4], BS, _root(""))
