"""SGLang's cache-aware and Dynamo's KV-router rules, as reimplemented for the simulator."""

from __future__ import annotations

import random

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.baselines import DynamoKvPolicy, SglangCacheAwarePolicy
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import RouteQuery, WorkerView
from kvmesh.coordinator.routing.router import make_policy
from kvmesh.proto.block_hash import BlockHash

CM = CostModel()


def view(w: str, matched: int = 0, running: int = 0, queued_tokens: int = 0) -> WorkerView:
    return WorkerView(WorkerId(w), 1000, 1000, 0.0, queued_tokens, running, matched, matched)


def query(rid: str, hashes: list[int], prompt_len: int | None = None) -> RouteQuery:
    n = prompt_len if prompt_len is not None else 16 * len(hashes)
    return RouteQuery(rid, [BlockHash(h) for h in hashes], n, 16)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_sglang_follows_its_own_routing_history_above_the_match_threshold() -> None:
    p = SglangCacheAwarePolicy(CM, random.Random(0))
    ws = [view("a"), view("b")]
    first = p.choose(query("r1", [1, 2, 3, 4]), ws).worker_id
    # 3 of 4 blocks (75% > 30%) were sent to `first`: it wins although the index shows nothing.
    assert p.choose(query("r2", [1, 2, 3, 9]), ws).worker_id == first
    # 1 of 4 blocks (25% <= 30%): the worker with the smaller tree gets it instead.
    other = "b" if first == "a" else "a"
    assert p.choose(query("r3", [1, 7, 8, 9]), ws).worker_id == other


def test_sglang_goes_to_the_shortest_queue_only_when_load_is_imbalanced() -> None:
    p = SglangCacheAwarePolicy(CM, random.Random(0))
    ws = [view("a"), view("b")]
    holder = p.choose(query("r1", [1, 2]), ws).worker_id
    other = "b" if holder == "a" else "a"
    loads = {holder: 60, other: 0}  # only 60 apart: balanced, cache affinity wins
    busy = [view(w, running=loads[w]) for w in ("a", "b")]
    assert p.choose(query("r2", [1, 2]), busy).worker_id == holder
    loads = {holder: 70, other: 5}  # 65 > 64 apart and 70 > 1.5 x 5: imbalanced
    busy = [view(w, running=loads[w]) for w in ("a", "b")]
    assert p.choose(query("r3", [1, 2]), busy).worker_id == other


def test_sglang_trims_each_tenant_to_its_size_limit() -> None:
    clock = Clock()
    p = SglangCacheAwarePolicy(CM, random.Random(0), clock)
    p.max_tree_size = 64  # tokens: 4 blocks of 16
    ws = [view("a")]
    p.choose(query("r1", [1, 2, 3]), ws)
    clock.now_s = 1.0
    p.choose(query("r2", [5, 6, 7]), ws)
    assert p.tree_tokens(WorkerId("a")) == 96
    clock.now_s = 200.0  # past the eviction interval: the next decision trims first
    p.choose(query("r3", [5, 6, 7]), ws)
    assert p.tree_tokens(WorkerId("a")) == 64  # the older chain lost its tail first


def test_dynamo_prices_prefill_and_active_blocks_in_blocks() -> None:
    p = DynamoKvPolicy(CM, random.Random(0))
    # a holds 3 of the 4 blocks: 1 prefill block + 4 new active blocks = 5; b: 4 + 4 = 8.
    d = p.choose(query("r1", [1, 2, 3, 4]), [view("a", matched=3), view("b")])
    assert d.worker_id == "a"
    assert sorted(s.cost_ms for s in d.scores) == [5.0, 8.0]
    assert p.active_blocks(WorkerId("a")) == 4


def test_dynamo_counts_shared_active_blocks_once_and_releases_them() -> None:
    p = DynamoKvPolicy(CM, random.Random(0))
    ws = [view("a", matched=4)]
    p.choose(query("r1", [1, 2, 3, 4]), ws)
    p.choose(query("r2", [1, 2, 3, 5], prompt_len=60), ws)
    assert p.active_blocks(WorkerId("a")) == 5 + 1  # 5 distinct full blocks + r2's partial tail
    p.on_request_done("r1")
    assert p.active_blocks(WorkerId("a")) == 4 + 1
    p.on_request_done("r2")
    assert p.active_blocks(WorkerId("a")) == 0


def test_dynamo_queued_prefill_tokens_push_requests_away() -> None:
    p = DynamoKvPolicy(CM, random.Random(0))
    d = p.choose(query("r1", [1, 2]), [view("a", matched=2, queued_tokens=16 * 10), view("b")])
    assert d.worker_id == "b"


def test_registry_builds_the_baselines() -> None:
    assert isinstance(make_policy("sglang", CM, random.Random(0)), SglangCacheAwarePolicy)
    assert isinstance(make_policy("dynamo", CM, random.Random(0)), DynamoKvPolicy)
