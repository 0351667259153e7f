"""Prefix-cache figures and the radix tree as wire messages (a Generate stream's cache facts,
Stats, ListWorkers, IndexTree, VerifyIndex): kept out of the servicer so it stays the RPC
plumbing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.coordinator.index.locked_mirror import NodeView
from kvmesh.coordinator.index.radix_tree import LinkCheck
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto.events import TIER_DEVICE
from kvmesh.workers.contract.replies import CacheStats


def cache_facts_message(event: StreamEvent, policy: str) -> pb.CacheFacts:
    """A Generate stream's first event as the response's `CacheFacts`: where the prompt's KV
    came from (host-tier hits count as cached)."""
    facts = event.prefill
    if facts is None:  # the worker's stream ended before its first token
        return pb.CacheFacts(worker_id=event.worker_id, policy=policy)
    return pb.CacheFacts(
        worker_id=event.worker_id,
        prompt_tokens=facts.prompt_tokens,
        cached_tokens=facts.local_tokens + facts.host_tokens,
        pulled_tokens=facts.pulled_tokens,
        computed_tokens=facts.computed_tokens,
        policy=policy,
    )


def cache_stats_message(stats: CacheStats) -> pb.CacheStats:
    return pb.CacheStats(
        enabled=stats.enabled,
        block_size=stats.block_size,
        kv_dtype=stats.kv_dtype,
        cache_epoch=stats.cache_epoch,
        num_lookup_hits=stats.num_lookup_hits,
        num_lookup_misses=stats.num_lookup_misses,
        local_hit_tokens=stats.local_hit_tokens,
        host_hit_tokens=stats.host_hit_tokens,
        pulled_hit_tokens=stats.pulled_hit_tokens,
        saved_prefill_tokens=stats.saved_prefill_tokens,
        num_device_evictions=stats.num_device_evictions,
        num_host_evictions=stats.num_host_evictions,
        num_preemptions=stats.num_preemptions,
        num_entries=stats.num_entries,
        num_device_entries=stats.num_device_entries,
        num_host_entries=stats.num_host_entries,
        num_bytes=stats.num_bytes,
    )


def tree_message(
    views: Sequence[NodeView], num_nodes: int, block_size: int
) -> pb.IndexTreeResponse:
    nodes = []
    for node, holders in views:
        nodes.append(
            pb.IndexTreeNode(
                block_hash=node.block_hash,
                parent_hash=node.parent_hash,
                depth=node.depth,
                num_tokens=node.depth * block_size,
                device_worker_ids=sorted(w for w, t in holders.items() if t == TIER_DEVICE),
                host_worker_ids=sorted(w for w, t in holders.items() if t != TIER_DEVICE),
                num_hits=node.num_hits,
            )
        )
    return pb.IndexTreeResponse(nodes=nodes, num_nodes=num_nodes)


def link_check_fields(check: LinkCheck) -> dict[str, Any]:
    """The VerifyIndexResponse fields that report the tree's parent links."""
    return {
        "num_tree_nodes": check.num_nodes,
        "num_orphans": check.num_orphans,
        "num_bad_depths": check.num_bad_depths,
        "num_unlinked": check.num_unlinked,
        "orphan_hashes": list(check.orphans),
        "bad_depth_hashes": list(check.bad_depths),
    }
