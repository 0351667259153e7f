from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvmesh.coordinator.index import hash_table
from kvmesh.coordinator.index.hash_table import FEW_HASHES, NOBODY, HashTable
from kvmesh.proto.block_hash import BlockHash

HASHES = [BlockHash(int(h)) for h in np.random.default_rng(0).integers(1, 2**63, 200)]


def put(table: HashTable, values: dict[BlockHash, int]) -> None:
    """Write as the mirror does: a hash the arrays have in `values`, any other in the delta."""
    wanted = np.fromiter(values, np.uint64, len(values))
    table.note_changing(wanted)
    for (h, s), row in zip(values.items(), table.find(wanted).tolist(), strict=True):
        if row >= 0:
            table.values[row] = s
        else:
            table.delta[h] = s


def test_lookup_reads_the_delta_before_a_merge_and_the_arrays_after() -> None:
    table = HashTable()
    put(table, {h: 1 + i % 3 for i, h in enumerate(HASHES)})
    want = [1 + i % 3 for i in range(len(HASHES))]
    assert table.lookup(HASHES).tolist() == want  # a long chain: vector rounds
    assert table.lookup_few(HASHES[:FEW_HASHES]) == want[:FEW_HASHES]
    table.check_invariants()  # merges
    assert not table.delta and len(table.keys) == len(HASHES)
    assert table.lookup(HASHES).tolist() == want
    assert table.lookup_few(HASHES[:FEW_HASHES]) == want[:FEW_HASHES]
    assert table.merged_values(np.fromiter(HASHES, np.uint64)).tolist() == want


def test_absent_and_released_hashes_read_as_nobody() -> None:
    table = HashTable()
    put(table, dict.fromkeys(HASHES[:100], 7))
    table.merge()
    put(table, dict.fromkeys(HASHES[:10], NOBODY))  # no holder left
    assert table.lookup(HASHES).tolist() == [NOBODY] * 10 + [7] * 90 + [NOBODY] * 100
    table.check_invariants()
    assert table.lookup(HASHES).tolist() == [NOBODY] * 10 + [7] * 90 + [NOBODY] * 100
    assert table.lookup_few(HASHES[:3] + HASHES[150:153]) == [NOBODY] * 6


def test_a_table_without_displaced_keys_finds_its_keys_and_no_other() -> None:
    """A hash whose home slot holds another key, or none, is absent when no key is displaced
    (the search of the displaced keys is skipped)."""
    table = HashTable()
    kept = [h for h in HASHES if h % 5 == 0][:3]
    put(table, dict.fromkeys(kept, 4))
    table.merge()
    assert not len(table._displaced_keys)
    rows = table.find(np.fromiter(HASHES, np.uint64)).tolist()
    assert [HASHES[i] for i, r in enumerate(rows) if r >= 0] == kept
    assert table.lookup(HASHES).tolist() == [4 if h in kept else NOBODY for h in HASHES]


def test_a_long_chain_missing_a_few_hashes_from_the_arrays_reads_them_from_the_delta() -> None:
    """However few of a chain the arrays miss, those in the delta are read there (the delta
    filter lets them through) and the rest read as nobody."""
    table = HashTable()
    put(table, dict.fromkeys(HASHES[:100], 2))
    table.merge()
    put(table, dict.fromkeys(HASHES[100:103], 5))  # three new blocks: into the delta
    assert len(table.delta) == 3
    chain = HASHES[:FEW_HASHES] + HASHES[100:104]
    assert table.lookup(chain).tolist() == [2] * FEW_HASHES + [5, 5, 5, NOBODY]
    chain = HASHES[:FEW_HASHES] + HASHES[150:152]
    assert table.lookup(chain).tolist() == [2] * FEW_HASHES + [NOBODY, NOBODY]


def _chain_lookups_agree(table: HashTable, chain: list[BlockHash]) -> list[int]:
    """`lookup_chain` (with and without the chain's array) reads what `lookup` does, at least
    through the first hash nobody holds; returns that leading part."""
    full = table.lookup(chain).tolist()
    leading = full[: full.index(NOBODY) + 1] if NOBODY in full else full
    for wanted in (np.fromiter(chain, np.uint64, len(chain)), None):
        read = table.lookup_chain(chain, wanted).tolist()
        assert len(read) >= len(leading) and read == full[: len(read)]
    return leading


def test_a_merge_appends_blocks_in_the_order_they_were_stored_and_a_compaction_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = HashTable()
    first, second = HASHES[:120], HASHES[120:]
    put(table, dict.fromkeys(first, 1))
    table.merge()
    put(table, dict.fromkeys(second, 2))
    table.merge()
    assert table.keys.tolist() == first + second
    # released (more than half of the blocks): dropped at the next merge, a compaction
    put(table, dict.fromkeys(first + second[::2], NOBODY))
    monkeypatch.setattr(hash_table, "_MIN_DELTA", 0)  # (a compaction at this size)
    added = BlockHash(HASHES[0] ^ 1)
    put(table, {added: 3})
    table.merge()
    assert table.keys.tolist() == second[1::2] + [added]
    table.check_invariants()


def test_a_chain_of_long_runs_with_a_few_short_ones_between_is_read_run_by_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stored to different depths one merge at a time (each merge appends its blocks), a chain is
    long runs and short ones: up to `_MAX_SHORT_STEPS` short ones, read without a vector round."""
    table = HashTable()
    cuts = [0, 40, 45, 50, 90, 95, 100, 105, 150, 155, 160, 200]  # 7 short runs, 4 long
    for a, b in itertools.pairwise(cuts):
        put(table, dict.fromkeys(HASHES[a:b], 6))
        table.merge()
        put(table, {BlockHash(HASHES[b - 1] ^ 1): 7})  # another chain's block between the runs
    table.merge()
    assert hash_table._MAX_SHORT_STEPS >= 7
    expected = _chain_lookups_agree(table, HASHES[:200])

    def no_vector_round(*args: object) -> None:
        raise AssertionError("read in vector rounds")

    monkeypatch.setattr(table, "lookup", no_vector_round)
    assert table.lookup_chain(HASHES[:200]).tolist() == expected == [6] * 200


def test_a_chain_stored_in_one_run_is_read_through_its_first_hash_nobody_holds() -> None:
    table = HashTable()
    put(table, dict.fromkeys(HASHES[:150], 4))
    table.merge()
    assert _chain_lookups_agree(table, HASHES[:150]) == [4] * 150
    assert _chain_lookups_agree(table, HASHES[:150] + HASHES[160:]) == [4] * 150 + [NOBODY]
    assert _chain_lookups_agree(table, HASHES[180:]) == [NOBODY]  # its first: nobody
    assert HashTable().lookup_chain(HASHES[:50]).tolist() == [NOBODY]  # an empty table


def test_chain_lookups_follow_runs_across_rows_the_delta_and_released_blocks() -> None:
    """Runs stored apart, a block at a time (the short-run fall-back), blocks in the delta in
    the middle of a chain, and released blocks still in the arrays: every read is `lookup`'s."""
    rng = np.random.default_rng(1)
    table = HashTable()
    order = rng.permutation(len(HASHES))
    # the chain's runs stored in shuffled pieces of 1 to 60 blocks, other blocks between them
    pieces, at = [], 0
    while at < len(HASHES):
        size = int(rng.integers(1, 60))
        pieces.append(list(range(at, min(at + size, len(HASHES)))))
        at += size
    for piece in (pieces[i] for i in rng.permutation(len(pieces))):
        put(table, {HASHES[i]: 1 + int(order[i]) % 3 for i in piece})
        put(table, {BlockHash(int(rng.integers(1, 2**63))): 7})
        if rng.random() < 0.5:
            table.merge()
    chain = list(HASHES)
    assert _chain_lookups_agree(table, chain) == [1 + int(order[i]) % 3 for i in range(200)]
    table.merge()
    put(table, {HASHES[i]: 9 for i in (30, 31, 100)})  # written in the arrays
    put(table, {BlockHash(HASHES[50] ^ 5): 6})  # a new block: into the delta
    assert _chain_lookups_agree(table, chain[:60] + [BlockHash(HASHES[50] ^ 5)] + chain[60:])
    put(table, {HASHES[i]: NOBODY for i in (70, 140)})  # released, kept in the arrays
    assert len(_chain_lookups_agree(table, chain)) == 71
    for start in range(0, 200, 17):
        _chain_lookups_agree(table, chain[start:])
    table.check_invariants()


def test_a_hash_past_the_home_slots_is_found_among_the_displaced_keys_in_ints() -> None:
    table = HashTable()
    put(table, dict.fromkeys(HASHES, 3))
    table.merge()
    assert len(table._displaced_keys)
    for h in table._displaced_keys.tolist():
        row = table._find_one(h)
        assert row >= 0 and table.keys[row] == h
        assert table.lookup_few([BlockHash(h)]) == [3]
    assert table._find_one(int(table._displaced_keys[0]) ^ 1) == -1
