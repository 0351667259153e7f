from __future__ import annotations

import numpy as np

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
