from __future__ import annotations

from kvmesh.coordinator.index.mirror import ApplyResult, IndexMirror, PrefixMatch, WorkerId
from kvmesh.proto.block_hash import BlockHash, block_hash_array
from kvmesh.proto.events import TIER_HOST, AllCleared, BlockRemoved, BlockStored, EventBatch

W0, W1 = WorkerId("w0"), WorkerId("w1")
H = [BlockHash(100 + i) for i in range(10)]


def batch(worker: str, seq: int, *events, gen: int = 1) -> EventBatch:  # type: ignore[no-untyped-def]
    return EventBatch(worker, gen, seq, tuple(events))


def loaded_mirror() -> IndexMirror:
    m = IndexMirror()
    m.load_worker(W0, 1, 0, [])
    m.load_worker(W1, 1, 0, [])
    return m


def test_match_counts_leading_blocks_per_worker() -> None:
    m = loaded_mirror()
    assert m.apply(batch("w0", 1, BlockStored(tuple(H[:4])))) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 1, BlockStored(tuple(H[:2]) + (H[3],)))) is ApplyResult.APPLIED
    assert m.match(H[:5]) == {W0: PrefixMatch(4, 4), W1: PrefixMatch(2, 2)}
    assert m.match([H[5]]) == {}
    m.check_invariants()


def test_host_tier_is_counted_apart() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored((H[0],)), BlockStored((H[1], H[2]), TIER_HOST)))
    assert m.match(H[:3]) == {W0: PrefixMatch(3, 1)}


def test_gap_and_new_generation_ask_for_resync_and_stale_is_ignored() -> None:
    m = loaded_mirror()
    assert m.apply(batch("w0", 1, BlockStored((H[0],)))) is ApplyResult.APPLIED
    assert m.apply(batch("w0", 1, BlockStored((H[1],)))) is ApplyResult.DUPLICATE
    assert m.apply(batch("w0", 3, BlockStored((H[2],)))) is ApplyResult.NEEDS_RESYNC
    assert m.apply(batch("w0", 2, BlockStored((H[3],)), gen=2)) is ApplyResult.NEEDS_RESYNC
    assert m.apply(batch("w0", 2, BlockStored((H[4],)), gen=0)) is ApplyResult.STALE
    assert m.apply(batch("w9", 2, BlockStored((H[4],)))) is ApplyResult.NEEDS_RESYNC
    assert m.worker_hashes(W0) == {H[0]: 0}
    m.check_invariants()


def test_remove_and_clear_and_purge_leave_no_trace() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(H[:3]))))
    m.apply(batch("w1", 1, BlockStored(tuple(H[:3]))))
    m.apply(batch("w0", 2, BlockRemoved((H[2],))))
    assert m.match(H[:3]) == {W0: PrefixMatch(2, 2), W1: PrefixMatch(3, 3)}
    m.apply(batch("w1", 2, AllCleared()))
    assert m.match(H[:3]) == {W0: PrefixMatch(2, 2)}
    assert m.remove_worker(W0) == 2
    assert m.num_blocks == 0
    m.check_invariants()


def test_removal_from_another_tier_keeps_the_indexed_copy() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored((H[0],))))
    m.apply(batch("w0", 2, BlockRemoved((H[0],), TIER_HOST)))
    assert m.match([H[0]]) == {W0: PrefixMatch(1, 1)}


def test_load_worker_replaces_previous_state() -> None:
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(H[:3]))))
    m.load_worker(W0, 2, 5, [(H[7], 0)])
    assert m.worker_hashes(W0) == {H[7]: 0}
    assert m.cursor(W0) == (2, 5)
    assert m.apply(batch("w0", 6, BlockStored((H[8],)), gen=2)) is ApplyResult.APPLIED
    m.check_invariants()


def test_removals_for_a_worker_with_nothing_indexed_are_applied_not_fatal() -> None:
    # Seen on a GPU cluster: a worker resynced from an empty snapshot, then its next batch
    # evicted blocks the snapshot never had; the mirror raised and its follower thread died.
    m = IndexMirror()
    m.load_worker(WorkerId("w1"), 1, 0, [])
    evicted = (BlockHash(5), BlockHash(6))
    assert m.apply(batch("w1", 1, BlockRemoved(evicted))) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 2, AllCleared())) is ApplyResult.APPLIED
    assert m.apply(batch("w1", 3, BlockStored((BlockHash(7),)))) is ApplyResult.APPLIED
    assert m.match([BlockHash(7)]) == {WorkerId("w1"): PrefixMatch(1, 1)}
    m.check_invariants()


def _expected_match(
    model: dict[WorkerId, dict[BlockHash, int]], chain: list[BlockHash]
) -> dict[WorkerId, PrefixMatch]:
    out = {}
    for w, blocks in model.items():
        n = next((i for i, h in enumerate(chain) if h not in blocks), len(chain))
        d = next((i for i, h in enumerate(chain[:n]) if blocks[h] != 0), n)
        if n:
            out[w] = PrefixMatch(n, d)
    return out


def test_random_events_keep_the_mirror_equal_to_a_plain_model() -> None:
    """Thousands of stores, removals, clears, resyncs and purges over shared chains, past several
    merges of the mirror's delta into its arrays: matches, per-worker hashes and counts stay
    those of a dict-of-dicts model, the radix tree links exactly the indexed blocks that were
    stored with a parent, and the invariants hold throughout."""
    import random

    rng = random.Random(7)
    workers = [WorkerId(f"w{i}") for i in range(9)]
    chains = [[BlockHash(c * 100_000 + i + 1) for i in range(300)] for c in range(8)]
    chains.append([BlockHash((1 << 64) - 1 - i) for i in range(50)])  # the top of the range
    m = IndexMirror()
    model: dict[WorkerId, dict[BlockHash, int]] = {}
    links: dict[BlockHash, tuple[BlockHash, int]] = {}  # hash -> (parent, depth)
    root = BlockHash(0x5EED)
    seq = dict.fromkeys(workers, 0)

    def unlink_unheld() -> None:
        held = set().union(*model.values())
        for h in [h for h in links if h not in held]:
            del links[h]

    for w in workers:
        m.load_worker(w, 1, 0, [])
        model[w] = {}
    for step in range(1500):
        w = rng.choice(workers)
        chain = rng.choice(chains)
        lo = rng.randrange(len(chain))
        hashes = chain[lo : lo + rng.randrange(1, 120)]
        tier = rng.choice([0, 0, TIER_HOST])
        kind = rng.random()
        seq[w] += 1
        if kind < 0.6:
            # Device stores name their parent (as workers do); host stores do not.
            parent = (chain[lo - 1] if lo else root) if tier == 0 else BlockHash(0)
            event: BlockStored | BlockRemoved | AllCleared = BlockStored(
                tuple(hashes), tier, parent, lo + 1 if parent else 0
            )
            model[w].update(dict.fromkeys(hashes, tier))
            if parent:
                for i, h in enumerate(hashes):
                    links[h] = (hashes[i - 1] if i else parent, lo + 1 + i)
        elif kind < 0.93:
            event = BlockRemoved(tuple(hashes), tier)
            for h in hashes:
                if model[w].get(h) == tier:
                    del model[w][h]
        elif kind < 0.96:
            event = AllCleared()
            model[w] = {}
        else:
            snapshot = [(h, t) for h, t in model[w].items() if rng.random() < 0.7]
            m.load_worker(w, 1, seq[w], snapshot)
            model[w] = dict(snapshot)
            unlink_unheld()
            continue
        assert m.apply(EventBatch(w, 1, seq[w], (event,))) is ApplyResult.APPLIED
        unlink_unheld()
        if step % 100 == 0:
            m.check_invariants()
            assert m.tree.num_nodes == len(links)
            assert all(
                m.tree.parent(h) == p and m.tree.depth(h) == d for h, (p, d) in links.items()
            )
        probe = rng.choice(chains)
        assert m.match(probe) == _expected_match(model, probe)
        short = probe[: rng.randrange(1, 50)]  # short chains are looked up one hash at a time
        assert m.match(short) == _expected_match(model, short)
        _assert_fleet_match_is_match(m, probe, workers[step % 3 :: 2])
    victim = workers[3]
    assert m.remove_worker(victim) == len(model.pop(victim))
    unlink_unheld()
    assert m.tree.num_nodes == len(links)
    for w in model:
        assert m.worker_hashes(w) == model[w]
        assert m.num_worker_blocks(w) == len(model[w])
    assert m.num_blocks == len(set().union(*model.values()))
    m.check_invariants()


def _assert_fleet_match_is_match(
    m: IndexMirror, hashes: list[BlockHash], fleet: list[WorkerId]
) -> None:
    """`match_fleet` writes exactly `match`'s numbers into the fleet's rows (a worker of the
    fleet the mirror does not know gets 0)."""
    fleet = [*fleet, WorkerId("not-indexed")]
    got = m.match_fleet(hashes, {w: i for i, w in enumerate(fleet)}, len(fleet))
    expected = m.match(hashes)
    nothing = PrefixMatch(0, 0)
    assert got.num_blocks.tolist() == [expected.get(w, nothing).num_blocks for w in fleet]
    assert got.num_device_blocks.tolist() == [
        expected.get(w, nothing).num_device_blocks for w in fleet
    ]
    assert got.deepest == max((p.num_blocks for p in expected.values()), default=0)
    # the chain handed over as its uint64 array too (a prepared prompt's): the same columns
    with_array = m.match_fleet(
        hashes, {w: i for i, w in enumerate(fleet)}, len(fleet), block_hash_array(hashes)
    )
    assert with_array.num_blocks.tolist() == got.num_blocks.tolist()
    assert with_array.num_device_blocks.tolist() == got.num_device_blocks.tolist()
    assert with_array.deepest == got.deepest


def test_fleet_match_is_match_past_64_workers() -> None:
    """Worker bits past the 64th (masks of several machine words) give the same fleet match."""
    import random

    rng = random.Random(3)
    chain = [BlockHash(7_000 + i) for i in range(60)]
    m = IndexMirror()
    workers = [WorkerId(f"w{i}") for i in range(70)]
    for n, w in enumerate(workers):
        m.load_worker(w, 1, 0, [])
        depth = rng.randrange(1, 61)
        m.apply(
            batch(
                w,
                1,
                BlockStored(tuple(chain[:depth])),
                BlockStored(tuple(chain[depth // 2 : depth]), TIER_HOST),
            )
        )
        if n in (10, 63, 64, 69):
            for probe in (chain, chain[:30], chain[:5]):
                _assert_fleet_match_is_match(m, probe, workers[: n + 1 : 3])
    m.remove_worker(workers[2])
    _assert_fleet_match_is_match(m, chain, workers)
    m.check_invariants()


def test_fleet_match_of_a_long_chain_in_arrays_is_match() -> None:
    """Up to 64 worker bits, every block on the device tier, a chain past `FEW_HASHES`: the
    fleet match is walked in array operations (`HolderSets.walk_low`), and gives `match`'s
    numbers: holes in a worker's run, the 64th bit, fleets leaving workers out; a host-tier
    block or a 65th bit sends it back to the Python walk, and the numbers stay `match`'s."""
    import random

    rng = random.Random(5)
    chain = [BlockHash(9_000 + i) for i in range(300)]
    m = IndexMirror()
    workers = [WorkerId(f"w{i}") for i in range(65)]
    for n, w in enumerate(workers[:64]):
        m.load_worker(w, 1, 0, [])
        depth = rng.randrange(1, 301)
        hole = rng.randrange(depth)
        m.apply(batch(w, 1, BlockStored(tuple(chain[:depth]))))
        if n % 4 == 1:  # a hole: the worker's prefix ends before its last block
            m.apply(batch(w, 2, BlockRemoved(tuple(chain[hole : hole + 3]))))
        if n in (0, 7, 62, 63):
            for probe in (chain, chain[:41], chain[100:]):
                _assert_fleet_match_is_match(m, probe, workers[: n + 1])
                _assert_fleet_match_is_match(m, probe, workers[: n + 1 : 3])
    m.check_invariants()  # merges: the chain now in the arrays, not the delta
    _assert_fleet_match_is_match(m, chain, workers[:64])
    m.load_worker(workers[64], 1, 0, [(chain[0], 0), (chain[1], 0)])  # the 65th bit
    _assert_fleet_match_is_match(m, chain, workers[:64:2])
    m.remove_worker(workers[64])
    stored = m.apply(batch(workers[5], 3, BlockStored(tuple(chain[:50]), TIER_HOST)))
    assert stored is ApplyResult.APPLIED
    _assert_fleet_match_is_match(m, chain, workers[:64])
    m.check_invariants()


def _same_home_slot(num_hashes: int) -> list[BlockHash]:
    """Hashes whose product with the index's multiplier differs only in the low bits, so all
    of them have the same home slot, whatever the table's size (one keeps it, the rest are
    displaced)."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 1 << 64)
    return [BlockHash(inverse * ((0x5A5A << 48) + j) % (1 << 64)) for j in range(num_hashes)]


def test_lookup_finds_blocks_far_from_their_home_slot() -> None:
    crowded = _same_home_slot(60)
    held, absent = crowded[:50], crowded[50:]
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(held))))
    m.apply(batch("w1", 1, BlockStored(tuple(H))))
    m.check_invariants()  # merges: one of the crowded hashes in its home slot, 49 displaced
    assert m.match(held) == {W0: PrefixMatch(50, 50)}
    assert m.indexed([*held[::-1], *absent, *H]) == [True] * 50 + [False] * 10 + [True] * 10
    assert m.indexed([*held[45:], *absent[:5]]) == [True] * 5 + [False] * 5  # one at a time
    m.apply(batch("w1", 2, BlockStored(tuple(held[:3]))))  # in the delta until the next merge
    assert m.match(held) == {W0: PrefixMatch(50, 50), W1: PrefixMatch(3, 3)}
    m.check_invariants()


def test_a_new_generations_first_batch_replaces_the_worker_without_a_resync() -> None:
    """Redis wipes a worker's blocks before its new generation's first batch; the mirror does
    the same, so a restarted (or new) worker's seq 1 needs no snapshot."""
    m = loaded_mirror()
    m.apply(batch("w0", 1, BlockStored(tuple(H[:3]))))
    m.apply(batch("w1", 1, BlockStored(tuple(H[:2]))))
    assert m.apply(batch("w0", 1, BlockStored((H[0], H[5])), gen=2)) is ApplyResult.STARTED
    assert m.worker_hashes(W0) == {H[0]: 0, H[5]: 0}  # H[1], H[2] went with generation 1
    assert m.cursor(W0) == (2, 1)
    assert m.apply(batch("w0", 2, BlockRemoved((H[5],)), gen=2)) is ApplyResult.APPLIED
    assert m.apply(batch("w9", 1, BlockStored((H[7],)))) is ApplyResult.STARTED  # a new worker
    assert m.match([H[0], H[1]]) == {W0: PrefixMatch(1, 1), W1: PrefixMatch(2, 2)}
    assert m.match([H[7]]) == {WorkerId("w9"): PrefixMatch(1, 1)}
    m.check_invariants()


def test_a_head_that_one_holder_set_holds_then_nobody_is_matched_as_match() -> None:
    """The common shape of a routed prompt: a head held by one set of workers, then blocks
    nobody holds (or the whole chain held by that set). The fleet's rows of the set are kept
    between decisions; workers outside the fleet, bits past the 64th, host-tier copies (of
    another chain, and of a head on both tiers) and a worker leaving must all give `match`'s
    numbers."""
    workers = [WorkerId(f"w{i}") for i in range(70)]
    head = [BlockHash(9_000 + i) for i in range(3)]
    long_chain = [*head, *(BlockHash(9_100 + i) for i in range(50))]
    other = [BlockHash(8_000 + i) for i in range(4)]
    m = IndexMirror()
    for n, w in enumerate(workers):
        m.load_worker(w, 1, 0, [])
        if n % 2 == 0:
            m.apply(batch(w, 1, BlockStored(tuple(head))))
        elif n in (1, 67):  # another chain on the host tier: holder sets with device != any
            m.apply(batch(w, 1, BlockStored(tuple(other), TIER_HOST)))
        elif n == 3:  # the other chain's head on the device: one of them on both tiers
            m.apply(batch(w, 1, BlockStored(tuple(other[:1]))))
    fleet = [*workers[::3], workers[1], WorkerId("not-indexed")]
    row_of = {w: i for i, w in enumerate(fleet)}
    for _ in range(2):  # the second time from the rows kept for the fleet
        for chain in (head, head[:2], [*head, BlockHash(1)], long_chain, other, other[:1]):
            got = m.match_fleet(chain, row_of, len(fleet))
            expected = m.match(chain)
            nothing = PrefixMatch(0, 0)
            assert got.num_blocks.tolist() == [expected.get(w, nothing).num_blocks for w in fleet]
            assert got.num_device_blocks.tolist() == [
                expected.get(w, nothing).num_device_blocks for w in fleet
            ]
            assert got.deepest == max(p.num_blocks for p in expected.values())
        m.check_invariants()
    m.remove_worker(workers[0])  # its bit goes: the fleet's rows are found again
    _assert_fleet_match_is_match(m, long_chain, fleet)
    got = m.match_fleet(head, row_of, len(fleet))
    assert got.num_blocks[row_of[workers[0]]] == 0 and got.num_blocks[row_of[workers[6]]] == 3
    m.check_invariants()
