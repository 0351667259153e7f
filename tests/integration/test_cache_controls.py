"""Cache figures, the prefix tree, a true reset and the bypass switch on a real cluster (real
Redis, real local Ray, two CPU workers), through the client and the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, fields

import pytest
import redis

from kvmesh.client import cli as kvmesh_cli
from kvmesh.client.client import Client
from kvmesh.client.errors import InvalidArgument
from kvmesh.client.results import CacheStats
from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.proto import redis_schema as schema
from tests.integration.helpers import start_deployment, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

BS = 16
PREFIX = [(i * 11) % 240 + 5 for i in range(80)]  # 5 full blocks


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = start_deployment(num_workers=2, num_blocks=96)
    yield d
    d.stop()


@pytest.fixture
def client(deployment: Deployment) -> Iterator[Client]:
    with Client(deployment.address, timeout_s=60) as c:
        yield c


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = kvmesh_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def summed(parts: list[CacheStats]) -> dict[str, int]:
    return {
        f.name: sum(getattr(p, f.name) for p in parts)
        for f in fields(CacheStats)
        if f.name.startswith("num_") or f.name.endswith("_tokens")
    }


def test_cluster_cache_figures_are_the_sum_of_the_workers(client: Client) -> None:
    prompt = [7, *PREFIX[:40]]
    first = client.generate(prompt, max_tokens=2)
    # Same prefix on the same worker: a local hit whatever the router would weigh on a busy host.
    hit = client.generate(prompt + [9], max_tokens=2, worker_id=first.worker_id)
    assert hit.cached_tokens == 32

    def adds_up() -> bool:
        cluster = client.stats().cache
        workers = [w.cache for w in client.list_workers()]
        whole = {k: v for k, v in asdict(cluster).items() if k in summed(workers)}
        return whole == summed(workers) and cluster.num_lookup_hits >= 1

    wait_for(adds_up, timeout_s=20, what="Stats.cache to equal the sum of ListWorkers' caches")
    cache = client.stats().cache
    assert cache.saved_prefill_tokens == (
        cache.local_hit_tokens + cache.host_hit_tokens + cache.pulled_hit_tokens
    )
    assert (cache.block_size, cache.kv_dtype, cache.enabled) == (BS, "float32", True)
    assert cache.num_entries > 0 and cache.num_bytes > 0


def test_index_tree_and_top_show_the_prompt_chain(
    client: Client, deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = [8, *PREFIX]
    worker = client.generate(prompt, max_tokens=2).worker_id
    chain = client.lookup(prompt).block_hashes
    wait_for(lambda: client.lookup(prompt).matches, what="the index to hold the prompt")
    client.lookup(prompt)  # a lookup whose match ends on the prompt's last full block
    tree = client.index_tree(max_nodes=100_000)
    by_hash = {n.block_hash: n for n in tree.nodes}
    held = [by_hash[h] for h in chain if h in by_hash]
    assert [n.depth for n in held] == list(range(1, len(held) + 1)) and len(held) >= 4
    assert all(n.num_tokens == n.depth * BS and worker in n.device_worker_ids for n in held)
    assert all(b.parent_hash == a.block_hash for a, b in zip(held, held[1:], strict=False))
    top = client.index_tree(max_nodes=50, hottest=True).nodes
    assert any(n.block_hash == held[-1].block_hash and n.num_hits >= 1 for n in top)

    address = ["--address", deployment.address]
    code, out, _ = run_cli(capsys, "index", "tree", *address, "--json")
    assert code == 0 and len(json.loads(out)["nodes"]) == tree.num_nodes
    code, out, _ = run_cli(capsys, "index", "top", *address, "--limit", "5")
    assert code == 0 and "hits" in out and f"{held[-1].block_hash:016x}" in out
    assert deployment.redis is not None
    verify = ["index", "verify", *address, "--redis-url", deployment.redis.url, "--json"]
    code, out, _ = run_cli(capsys, *verify)
    report = json.loads(out)
    assert code == 0 and report["link_problems"] == []
    assert report["tree_nodes"][deployment.address] >= len(held)
    # A link in Redis that disagrees with its parent's depth is what a cold coordinator would
    # start from: verify names it.
    r = redis.Redis.from_url(deployment.redis.url)
    key, field = schema.worker_blocks_key(worker), f"{held[-1].block_hash:016x}"
    value = r.hget(key, field)
    assert value is not None and int(value[17:], 16) == held[-1].depth
    r.hset(key, field, value[:17] + b"%08x" % 99)
    try:
        code, out, _ = run_cli(capsys, *verify[:-1], "--wait", "0.2")
        assert code == 1 and "LINKS redis: 1 block(s) not one level below" in out
    finally:
        r.hset(key, field, value)
    code, _, err = run_cli(capsys, "index", "top", *address, "--limit", "0")
    assert code != 0 and "--limit" in err
    with pytest.raises(InvalidArgument, match="max_nodes"):
        client.index_tree(max_nodes=100_001)
    code, out, _ = run_cli(capsys, "stats", *address, "--json")
    stats = json.loads(out)
    assert code == 0 and stats["num_tree_nodes"] >= len(held)
    assert set(stats["cache"]) == {f.name for f in fields(CacheStats)}


def test_clear_cache_moves_the_epoch_so_nothing_before_it_matches(client: Client) -> None:
    prompt = [9, *PREFIX]
    client.generate(prompt, max_tokens=2)
    before = client.lookup(prompt)
    wait_for(lambda: client.lookup(prompt).matches, what="the index to hold the prompt")
    client.clear_cache()
    epoch = client.last_cache_epoch
    assert epoch >= 1
    after = client.lookup(prompt)
    assert after.block_hashes != before.block_hashes and not after.matches
    again = client.generate(prompt, max_tokens=2)
    assert (again.cached_tokens, again.pulled_tokens) == (0, 0)
    wait_for(lambda: client.stats().cache.cache_epoch == epoch, what="the workers' epoch")
    assert all(w.cache.cache_epoch == epoch for w in client.list_workers())


def test_bypass_cache_reuses_nothing(client: Client) -> None:
    prompt = [10, *PREFIX]
    client.generate(prompt, max_tokens=2)
    wait_for(lambda: client.lookup(prompt).matches, what="the index to hold the prompt")
    assert client.route(prompt).matched_tokens > 0
    assert client.route(prompt, bypass_cache=True).matched_tokens == 0
    bypass = client.generate(prompt, max_tokens=2, bypass_cache=True)
    assert (bypass.cached_tokens, bypass.pulled_tokens) == (0, 0)
    assert bypass.computed_tokens == len(prompt)
