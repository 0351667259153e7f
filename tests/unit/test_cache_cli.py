"""The CLI and wire side of the cache controls: flags, the tree's rendering, the Stats fields."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvmesh.client import wire
from kvmesh.client.commands import render_stats
from kvmesh.client.environment import read_environment
from kvmesh.client.index_tree import render_top, render_tree
from kvmesh.client.parser import build_parser
from kvmesh.client.results import CacheStats, IndexTree, TreeNode
from kvmesh.coordinator.cluster.launcher import deployment_config
from kvmesh.proto import kvmesh_pb2 as pb
from tests.unit.generate_args import generate_args


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser(read_environment({})).parse_args(list(argv))


def test_no_prefix_cache_reaches_every_worker_config() -> None:
    args = parse("up", "--no-prefix-cache", "--port", "0")
    assert deployment_config(args, embedded_redis=True).worker.prefix_cache is False
    assert deployment_config(parse("up"), embedded_redis=True).worker.prefix_cache is True


def test_bypass_cache_flag_reaches_the_request() -> None:
    args = parse("generate", "--tokens", "1,2,3", "--bypass-cache")
    assert args.bypass_cache is True
    request = wire.build_generate_request([1, 2, 3], **generate_args(bypass_cache=True))
    assert request.bypass_cache
    route = wire.build_route_request(
        [1], prompt=None, session_id="", cache_salt="", bypass_cache=True
    )
    assert route.bypass_cache


@pytest.mark.parametrize("argv", [("tree", "--max-nodes", "0"), ("top", "--limit", "x")])
def test_tree_sizes_out_of_range_are_refused(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        parse("index", *argv)
    assert raised.value.code == 2 and "[1, 100000]" in capsys.readouterr().err


def test_cache_stats_mirror_the_message_field_for_field() -> None:
    assert [f.name for f in fields(CacheStats)] == [f.name for f in pb.CacheStats.DESCRIPTOR.fields]
    message = pb.StatsResponse(cache=pb.CacheStats(num_lookup_hits=3, kv_dtype="bfloat16"))
    stats = wire.stats_from_proto(message)
    assert (stats.cache.num_lookup_hits, stats.cache.kv_dtype) == (3, "bfloat16")
    text = render_stats(stats)
    assert "cache.num_lookup_hits" in text and "cache.kv_dtype" in text


def node(h: int, parent: int, depth: int, num_hits: int = 0) -> TreeNode:
    return TreeNode(h, parent, depth, depth * 16, ["w0"], ["w1"] if h == 3 else [], num_hits)


def test_tree_is_drawn_indented_under_parents_and_says_when_cut() -> None:
    tree = IndexTree([node(1, 99, 1), node(2, 1, 2), node(3, 1, 2)], num_nodes=5)
    lines = render_tree(tree).splitlines()
    assert lines[1].startswith("0000000000000001")
    assert lines[2].startswith("  0000000000000002")
    assert "w0 host:w1" in lines[3]
    assert lines[-1] == "3 of 5 block(s) shown (raise --max-nodes)"
    top = render_top(IndexTree([node(2, 1, 2, num_hits=4)], num_nodes=5))
    assert "0000000000000002" in top and " 4 " in top


def test_verify_fails_on_a_mirror_whose_tree_has_broken_links() -> None:
    from kvmesh.client.index_verify import compare, render
    from kvmesh.client.results import IndexReport, LinkReport, WorkerIndexView

    views = [WorkerIndexView("w0", True, [1, 2], [1, 2], 1, 1, True)]
    clean = compare({"a:1": IndexReport(views, True, LinkReport(num_tree_nodes=2))}, None)
    assert clean.consistent
    broken = LinkReport(num_tree_nodes=2, num_orphans=1, orphan_hashes=[2], num_bad_depths=1)
    report = compare({"a:1": IndexReport(views, True, broken)}, None)
    assert not report.consistent and len(report.link_problems) == 2
    text = render(report, 1, redis_compared=False)
    assert "LINKS mirror@a:1: 1 block(s) whose parent no worker holds" in text
    assert "0000000000000002" in text and text.endswith("2 difference(s) after 1 attempt(s)")
