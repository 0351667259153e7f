"""`kvmesh index tree` and `kvmesh index top`: a coordinator's prefix tree, read through the
admin RPC IndexTree.

    tree   the tree in order, each block indented under its parent, with its depth, prefix length
           in tokens, holders per tier and hits (lookups whose longest match ended on it)
    top    the most hit blocks: the hottest prefixes, each named by its last block
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvmesh.client.commands import client_from_args
from kvmesh.client.results import IndexTree, TreeNode
from kvmesh.client.table import format_table

_INDENT = "  "
_MAX_INDENT_LEVELS = 32  # deeper blocks print at this indent (the depth column stays exact)


def run_index_tree(args: argparse.Namespace) -> int:
    with client_from_args(args, args.address) as client:
        tree = client.index_tree(max_nodes=args.max_nodes)
    _print(tree, args.json, render_tree)
    return 0


def run_index_top(args: argparse.Namespace) -> int:
    with client_from_args(args, args.address) as client:
        tree = client.index_tree(max_nodes=args.limit, hottest=True)
    _print(tree, args.json, render_top)
    return 0


def _print(tree: IndexTree, as_json: bool, render: object) -> None:
    if as_json:
        json.dump(asdict(tree), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        assert callable(render)
        print(render(tree))


def _holders(node: TreeNode) -> str:
    device = ",".join(node.device_worker_ids) or "-"
    host = ",".join(node.host_worker_ids) or "-"
    return f"{device}" if host == "-" else f"{device} host:{host}"


def render_tree(tree: IndexTree) -> str:
    if not tree.nodes:
        return "the index holds no linked blocks"
    levels: dict[int, int] = {}  # block -> indent level, within what was sent
    rows = []
    for n in tree.nodes:
        level = levels.get(n.parent_hash, -1) + 1
        levels[n.block_hash] = level
        name = _INDENT * min(level, _MAX_INDENT_LEVELS) + f"{n.block_hash:016x}"
        rows.append([name, n.depth, n.num_tokens, _holders(n), n.num_hits])
    table = format_table(["block", "depth", "tokens", "holders", "hits"], rows)
    return table + _footer(tree)


def render_top(tree: IndexTree) -> str:
    if not tree.nodes:
        return "no lookup has matched a linked block yet"
    rows = [
        [f"{n.block_hash:016x}", n.num_hits, n.depth, n.num_tokens, _holders(n)] for n in tree.nodes
    ]
    return format_table(["prefix (last block)", "hits", "depth", "tokens", "holders"], rows)


def _footer(tree: IndexTree) -> str:
    if len(tree.nodes) >= tree.num_nodes:
        return f"\n{tree.num_nodes} block(s)"
    return f"\n{len(tree.nodes)} of {tree.num_nodes} block(s) shown (raise --max-nodes)"
