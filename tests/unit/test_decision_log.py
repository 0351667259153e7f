"""The decision log: entries applied in sequence order, each once; a placement on the wire; a
policy's `choose` = `propose` then `place` (a replica's commits: test_decision_replica.py)."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.coordinator.routing.decision_log import LogCursor
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.placements import (
    Placement,
    PlacementDecodeError,
    decode_placement,
    encode_placement,
)
from tests.unit.test_coordinator import PROMPT, make


def placement(rid: str, worker: str = "w0", origin: str = "a") -> Placement:
    return Placement(rid, origin, worker, "", 100, 60, 3.5, (BlockHash(1), BlockHash(2)))


def test_entries_apply_in_sequence_order_each_once() -> None:
    cursor = LogCursor()
    p1, p2, p3 = placement("r1"), placement("r2"), placement("r3")
    assert cursor.offer([(2, p2), (3, p3)]) == []  # 1 is missing: wait for it
    cursor.check_invariants()
    assert cursor.offer([(1, p1), (2, p2)]) == [p1, p2, p3]
    assert cursor.offer([(3, p3)]) == []  # already applied
    assert cursor.applied_seq == 3
    cursor.check_invariants()


def test_a_gap_that_never_fills_is_stepped_over_and_counted() -> None:
    cursor = LogCursor()
    p5 = placement("r5")
    cursor.offer([(5, p5)])
    assert cursor.skip_to(4) == [p5]
    assert cursor.applied_seq == 5 and cursor.num_skipped == 4


def test_a_log_that_went_back_is_followed_from_its_new_end() -> None:
    cursor = LogCursor(applied_seq=10)
    cursor.offer([(12, placement("r12"))])
    assert cursor.skip_to(0) == []
    assert cursor.applied_seq == 0
    cursor.check_invariants()
    assert cursor.offer([(1, placement("x"))]) == [placement("x")]


def test_a_placement_survives_the_wire() -> None:
    hashes = tuple(BlockHash(h) for h in (1, 2**64 - 1))
    p = Placement("r1", "a", "w3", "s", 1000, 400, 12.25, hashes, 37, BlockHash(2**64 - 2))
    assert decode_placement(encode_placement(p)) == p
    # An entry from a replica that still sends the request's max_tokens ("m") reads the same.
    older = msgpack.packb({**msgpack.unpackb(encode_placement(p)), "m": 640})
    assert decode_placement(older) == p
    with pytest.raises(PlacementDecodeError):
        decode_placement(b"\x93\x01\x02")
    with pytest.raises(ValueError):
        Placement("r1", "a", "w0", "", 10, 11, 1.0)


def test_choose_is_propose_then_place() -> None:
    """`choose` remembers exactly what `place` of its decision would."""
    a, _, _, _ = make(("w0", "w1", "w2"))
    b, _, _, _ = make(("w0", "w1", "w2"))
    assert isinstance(a.policy, KvmeshPolicy) and isinstance(b.policy, KvmeshPolicy)
    for k in range(6):
        prompt = a.prompts.prepare(PROMPT[: 200 + 97 * k], "", "")
        answer = (None, 8, 640)[k % 3]
        decision = a.route(prompt, f"s{k % 2}", f"r{k}", answer)
        query = _query(prompt, f"s{k % 2}", f"r{k}", answer)
        b.policy.place(b.policy.placement_of(query, decision, decision.indexed_blocks), 0.0)
    assert policy_state(a) == policy_state(b)


def _query(prompt, session: str, rid: str, max_tokens: int | None = None):  # type: ignore[no-untyped-def]
    from kvmesh.coordinator.routing.policy import RouteQuery

    n = len(prompt.token_ids)
    return RouteQuery(rid, prompt.block_hashes, n, 16, session, max_tokens=max_tokens)


def policy_state(c) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    """What the kvmesh policy remembers, per worker: recent work and requests, running context
    tokens, routed blocks of the test prompt, reused prefixes' blocks, the sessions' workers."""
    policy = c.policy
    ids = sorted(c.registry.routable())
    work, requests = policy._recent.snapshot(ids, 0.0)
    running = policy._running.tokens_many(ids).tolist()
    hashes = c.prompts.prepare(PROMPT, "", "").block_hashes
    routed = [policy._routed.extend(w, hashes, 0) for w in ids]
    sessions = [policy._sessions.get(s) for s in ("s0", "s1")]
    reused = policy._reused.num_blocks_many(ids).tolist()
    return (work, requests, running, routed, sessions, reused)
